import json

import numpy as np
import pytest

from moe.data import TokenDataError, TokenDataset, open_token_file, read_sidecar, write_token_file


def test_round_trip_uint16_headerless(tmp_path):
    tokens = np.array([5, 1, 2, 0, 7, 65535 - 1, 0])
    info = write_token_file(tmp_path / "a.npy", tokens, vocab_size=65536, eos_id=0, tokenizer_hash="h")
    raw = (tmp_path / "a.npy").read_bytes()
    assert len(raw) == 2 * len(tokens)  # no NumPy header
    assert np.frombuffer(raw, dtype="<u2").tolist() == tokens.tolist()
    arr, info2 = open_token_file(tmp_path / "a.npy", tokenizer_hash="h")
    assert arr.tolist() == tokens.tolist()
    assert info == info2 and info.dtype == "uint16" and info.num_tokens == 7
    assert json.loads((tmp_path / "a.npy.json").read_text())["sha256"] == info.sha256


def test_large_vocab_uses_uint32(tmp_path):
    write_token_file(tmp_path / "b.npy", np.array([100_000, 3]), vocab_size=100_352, eos_id=3)
    arr, info = open_token_file(tmp_path / "b.npy")
    assert info.dtype == "uint32" and arr.tolist() == [100_000, 3]


def test_reads_files_written_by_olmo_core_style_writers(tmp_path):
    # A plain tofile() of uint32 ids plus our sidecar is exactly the layout.
    ids = np.arange(10, dtype=np.uint32)
    ids.tofile(tmp_path / "c.npy")
    from moe.data.tokens import file_sha256

    (tmp_path / "c.npy.json").write_text(
        json.dumps(
            {
                "dtype": "uint32",
                "vocab_size": 100_352,
                "eos_id": 0,
                "pad_id": 1,
                "tokenizer_hash": None,
                "num_tokens": 10,
                "sha256": file_sha256(tmp_path / "c.npy"),
            }
        )
    )
    assert open_token_file(tmp_path / "c.npy")[0].tolist() == list(range(10))


def test_out_of_vocab_token_refused_at_write(tmp_path):
    with pytest.raises(TokenDataError, match="outside the vocabulary"):
        write_token_file(tmp_path / "a.npy", np.array([300]), vocab_size=256, eos_id=0)
    assert not (tmp_path / "a.npy").exists()


def test_corrupt_file_is_refused_by_checksum(tmp_path):
    write_token_file(tmp_path / "a.npy", np.arange(100), vocab_size=256, eos_id=0)
    data = bytearray((tmp_path / "a.npy").read_bytes())
    data[10] ^= 0xFF
    (tmp_path / "a.npy").write_bytes(bytes(data))
    with pytest.raises(TokenDataError, match=r"a\.npy: sha256 .* does not match the sidecar"):
        open_token_file(tmp_path / "a.npy")
    open_token_file(tmp_path / "a.npy", verify_checksum=False)  # explicitly opted out


def test_truncated_file_is_refused(tmp_path):
    write_token_file(tmp_path / "a.npy", np.arange(100), vocab_size=256, eos_id=0)
    (tmp_path / "a.npy").write_bytes((tmp_path / "a.npy").read_bytes()[:-2])
    with pytest.raises(TokenDataError, match="truncated or corrupt"):
        open_token_file(tmp_path / "a.npy", verify_checksum=False)


def test_tokenizer_mismatch_and_missing_sidecar_are_refused(tmp_path):
    write_token_file(tmp_path / "a.npy", np.arange(10), vocab_size=256, eos_id=0, tokenizer_hash="abc")
    with pytest.raises(TokenDataError, match="the tokenizer does not match the data"):
        open_token_file(tmp_path / "a.npy", tokenizer_hash="xyz")
    (tmp_path / "a.npy.json").unlink()
    with pytest.raises(TokenDataError, match="sidecar a.npy.json not found"):
        read_sidecar(tmp_path / "a.npy")
    with pytest.raises(TokenDataError, match="token file not found"):
        read_sidecar(tmp_path / "missing.npy")


def test_dataset_windows_cover_every_token_once(tmp_path):
    write_token_file(tmp_path / "a.npy", np.arange(23), vocab_size=256, eos_id=0)
    write_token_file(tmp_path / "b.npy", np.arange(100, 111), vocab_size=256, eos_id=0)
    ds = TokenDataset([str(tmp_path)], seq_len=5)
    # a: (23-1)//5 = 4 windows; b: (11-1)//5 = 2 windows
    assert len(ds) == 6
    assert ds.window(0).tolist() == [0, 1, 2, 3, 4, 5]
    assert ds.window(1).tolist() == [5, 6, 7, 8, 9, 10]
    assert ds.window(4).tolist() == [100, 101, 102, 103, 104, 105]
    assert ds.batch(np.array([5, 0])).shape == (2, 6)


def test_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(TokenDataError, match="no token files"):
        TokenDataset([str(tmp_path / "*.npy")], seq_len=4)
    write_token_file(tmp_path / "a.npy", np.arange(3), vocab_size=256, eos_id=0)
    with pytest.raises(TokenDataError, match="hold no sequence of 5 tokens"):
        TokenDataset([str(tmp_path)], seq_len=4)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.update(vocab_size="512"), "part.npy.json: vocab_size: expected an integer, got '512'"),
        (lambda s: s.update(eos_id=10**6), "eos_id 1000000 is not a token id below vocab_size 512"),
        (lambda s: s.update(num_tokens=-1), r"part.npy.json: num_tokens: expected an integer in \[0, .*\], got -1"),
        (lambda s: s.update(sha256=None), "part.npy.json: sha256: expected a string, got None"),
        (lambda s: s.update(dtype="uint16", vocab_size=70000), "dtype uint16 cannot hold vocab_size 70000"),
        (lambda s: s.clear() or s.update(x=[1]), "part.npy.json: dtype: missing"),
        (lambda s: s.update(shard=3), "part.npy.json: shard: unknown key"),
        (lambda s: s.update(format="olmo-core-tokens/2"), "part.npy.json: format: expected one of olmo-core-tokens/1"),
        (lambda s: s.update(tokenizer_hash="h" * 300), "part.npy.json: tokenizer_hash: expected a string of at most 256"),
    ],
    ids=[
        "vocab-size-text",
        "eos-outside-vocab",
        "negative-count",
        "no-digest",
        "dtype-too-small",
        "fields-missing",
        "unknown-key",
        "other-format",
        "long-text",
    ],
)
def test_a_sidecar_with_wrong_field_types_is_one_error_naming_the_field(tmp_path, edit, message):
    path = tmp_path / "part.npy"
    write_token_file(path, np.arange(100) % 50, vocab_size=512, eos_id=0, tokenizer_hash="abc")
    side = tmp_path / "part.npy.json" if (tmp_path / "part.npy.json").exists() else next(tmp_path.glob("*.json"))
    data = json.loads(side.read_text())
    edit(data)
    side.write_text(json.dumps(data))
    with pytest.raises(TokenDataError, match=message):
        read_sidecar(path)


def test_a_sidecar_that_is_a_list_is_one_error(tmp_path):
    path = tmp_path / "part.npy"
    write_token_file(path, np.arange(10), vocab_size=512, eos_id=0, tokenizer_hash="abc")
    next(tmp_path.glob("*.json")).write_text("[1, 2]")
    with pytest.raises(TokenDataError, match=r"part.npy.json: the file: expected a mapping, got \[1, 2\]"):
        read_sidecar(path)


def test_a_sidecar_with_nan_or_too_large_is_one_error(tmp_path):
    path = tmp_path / "part.npy"
    write_token_file(path, np.arange(10), vocab_size=512, eos_id=0)
    side = tmp_path / "part.npy.json"
    side.write_text(side.read_text().replace('"num_tokens": 10', '"num_tokens": NaN'))
    with pytest.raises(TokenDataError, match="part.npy.json: not valid JSON .*NaN is not a number JSON allows"):
        read_sidecar(path)
    side.write_text(" " * (2 << 20))
    with pytest.raises(TokenDataError, match=r"part.npy.json: \d+ bytes, more than the 1048576"):
        read_sidecar(path)


def test_a_fifo_in_place_of_the_sidecar_is_refused_at_once(tmp_path):
    """Issue 50: a FIFO where the sidecar belongs is one error, not a read that never returns."""
    import os
    import threading

    path = tmp_path / "part.npy"
    write_token_file(path, np.arange(10), vocab_size=512, eos_id=0)
    (tmp_path / "part.npy.json").unlink()
    os.mkfifo(tmp_path / "part.npy.json")
    raised = []
    t = threading.Thread(target=lambda: raised.append(pytest.raises(TokenDataError, read_sidecar, path)), daemon=True)
    t.start()
    t.join(5)
    assert raised, "reading a FIFO sidecar blocked"
    assert "part.npy.json: not a regular file" in str(raised[0].value)
