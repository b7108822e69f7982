from moe.plan.report import count


def test_parameter_counts_read_at_any_scale():
    assert [count(n) for n in (1_884_000_000, 12_345_678, 98_304, 512)] == ["1.884 B", "12.35 M", "98.3 K", "512"]
