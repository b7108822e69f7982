import numpy as np
import pytest

from moe.data import BatchLoader, TokenDataError, TokenDataset, write_token_file


@pytest.fixture
def dataset(tmp_path):
    # window i starts with token 10*i, so a batch row identifies its sequence
    for f in range(3):
        write_token_file(tmp_path / f"{f}.npy", np.arange(f * 1000, f * 1000 + 101) % 60000, vocab_size=60000, eos_id=0)
    return TokenDataset([str(tmp_path)], seq_len=10)


def ids(batches):
    return [int(row[0]) for b in batches for row in b]


def test_epoch_visits_every_sequence_once_in_a_seeded_order(dataset):
    loader = BatchLoader(dataset, global_batch_size=6, micro_batch_size=3, seed=1)
    seen = []
    for _ in range(loader.batches_per_epoch):
        seen += ids(loader.next_batch())
    assert len(seen) == len(set(seen)) == 30
    again = BatchLoader(dataset, global_batch_size=6, micro_batch_size=3, seed=1)
    assert ids(again.next_batch()) == seen[:6]
    other = BatchLoader(dataset, global_batch_size=6, micro_batch_size=3, seed=2)
    assert ids(other.next_batch()) != seen[:6]
    # the next epoch is a different permutation
    assert ids(loader.next_batch()) != seen[:6]
    assert loader.state.epoch == 1


def test_data_parallel_ranks_partition_the_global_batch(dataset):
    whole = BatchLoader(dataset, global_batch_size=8, micro_batch_size=2, seed=0)
    ranks = [BatchLoader(dataset, global_batch_size=8, micro_batch_size=2, seed=0, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(5):
        full = ids(whole.next_batch())
        parts = [ids(r.next_batch()) for r in ranks]
        assert parts[0] + parts[1] == full


def test_resume_from_state_continues_exactly(dataset):
    a = BatchLoader(dataset, global_batch_size=4, micro_batch_size=4, seed=3)
    for _ in range(9):  # crosses an epoch boundary (7 batches per epoch)
        a.next_batch()
    state = a.state_dict()
    expected = [ids(a.next_batch()) for _ in range(4)]
    b = BatchLoader(dataset, global_batch_size=4, micro_batch_size=4, seed=3)
    b.load_state_dict(state)
    assert [ids(b.next_batch()) for _ in range(4)] == expected


def test_too_little_data_for_one_batch(dataset):
    with pytest.raises(TokenDataError, match="fewer than one global batch of 64"):
        BatchLoader(dataset, global_batch_size=64, micro_batch_size=8, seed=0)
