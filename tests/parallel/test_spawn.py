"""moe.parallel.spawn: ranks get torchrun's rendezvous environment, and a failing rank is named
with its exit code and the end of what it wrote, the others stopped."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from moe.parallel.spawn import RankFailure, RanksFailed, rendezvous_env, run_ranks, start_ranks

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _write_env(rank: int, world: int, out: str, extra: str) -> None:
    Path(out, f"{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in (*ENV_KEYS, extra)}))


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")
    time.sleep(120)  # stopped by the group once rank 1 has failed


def test_function_ranks_see_the_rendezvous_environment(tmp_path):
    run_ranks(_write_env, 2, str(tmp_path), "EXTRA", env={"EXTRA": "yes"})
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"] and seen[0]["MASTER_ADDR"] == "127.0.0.1"
    for rank, env in enumerate(seen):
        assert env == {**rendezvous_env(rank, 2, int(env["MASTER_PORT"])), "EXTRA": "yes"}


def test_a_failing_function_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as caught:
        run_ranks(_fail_on_one, 2)
    failure = caught.value.failure
    assert (failure.rank, failure.exit_code) == (1, 1)
    assert "ValueError: rank one refuses" in failure.tail and "rank 1 exited with code 1" in str(caught.value)
    assert time.monotonic() - start < 60  # rank 0 was stopped, not waited for


def test_command_ranks_write_their_logs_and_a_failure_names_the_rank(tmp_path):
    code = (
        "import os, sys, time\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'port', os.environ['MASTER_PORT'], flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('something went wrong', file=sys.stderr)\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    group = start_ranks([sys.executable, "-c", code], 2, logs=logs, cwd=REPO)
    codes = group.wait(grace=5)
    assert codes[1] == 3 and codes[0] != 0  # rank 0 stopped
    assert group.failure == RankFailure(1, 3, group.failure.tail)
    assert group.failure.tail.splitlines()[-1] == "something went wrong"
    with pytest.raises(RanksFailed, match="rank 1 exited with code 3"):
        group.check()
    port = logs[0].read_text().split()[-1]
    assert logs[0].read_text().startswith("rank 0 of 2 port") and logs[1].read_text().startswith(f"rank 1 of 2 port {port}")


def test_ranks_past_the_timeout_are_killed(tmp_path):
    group = start_ranks([sys.executable, "-c", "import time; time.sleep(120)"], 1, logs=[tmp_path / "r.log"])
    assert group.wait(timeout=1) == [-9]
    assert "killed by SIGKILL" in str(group.failure)
