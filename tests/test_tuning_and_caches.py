"""Tuned-config cache and kernel disk cache: round trip, corruption, concurrent writers."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from tilelang_ops import cli, tuning
from tilelang_ops.kernels.elementwise import AddConfig
from tests.helpers import ROOT, child_env


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_loaded", None)
    monkeypatch.setattr(tuning, "_warned_corrupt", False)
    return tmp_path


def test_store_lookup_round_trip(tuned_dir):
    key = tuning.entry_key("add", "bfloat16", {"n": 4}, "any", "NVIDIA H200", "sm_90a")
    assert tuning.lookup(key) is None
    tuning.store(key, {"block": 4096, "threads": 128}, ms=0.5)
    assert tuning.lookup(key) == {"block": 4096, "threads": 128}
    tuning._loaded = None  # a new process reads the file
    assert tuning.lookup(key) == {"block": 4096, "threads": 128}
    assert tuning.config_from(AddConfig, tuning.lookup(key), AddConfig()) == AddConfig(4096, 128)
    assert tuning.config_from(AddConfig, {"block": 1, "warps": 4}, AddConfig()) == AddConfig()  # unknown field → default
    # a field the dataclass gained after the entry was stored takes its declared default
    assert tuning.config_from(AddConfig, {"block": 1024}, AddConfig()) == AddConfig(1024, AddConfig().threads)


@pytest.mark.parametrize("confirmed", [False, True])
def test_tune_keeps_the_default_unless_the_winner_wins_again(tuned_dir, monkeypatch, confirmed):
    """The search's fastest config is timed again against the default, in turns; a winner by
    noise (faster once, slower when re-timed) does not replace the default."""
    import torch

    from tilelang_ops import runtime

    monkeypatch.setattr(runtime, "arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    default, lucky, slow = AddConfig(1024, 128), AddConfig(2048, 128), AddConfig(4096, 256)
    first = {default: 1.0, lucky: 0.9, slow: 1.5}  # the search pass
    again = {default: 1.0, lucky: 0.95 if confirmed else 1.02}  # the confirmation
    calls = []

    def time_fn(fn):
        cfg = fn()
        calls.append(cfg)
        return (first if calls.count(cfg) == 1 else again)[cfg]

    tunable = tuning.Tunable(
        "add", {}, (torch.bfloat16,), lambda shape, dtype, device: ({"n": shape[0]}, "any"),
        lambda shape, dtype: [default, lucky, slow], lambda shape, dtype: default,
        lambda cfg, shape, dtype, device: (lambda: cfg),
    )
    (row,) = tuning.tune(tunable, [(4096,)], torch.bfloat16, "cuda", time_fn)
    assert calls.count(lucky) == 4 and calls.count(default) == 4 and calls.count(slow) == 1
    want = lucky if confirmed else default
    key = tuning.entry_key("add", "bfloat16", {"n": 4096}, "any", "NVIDIA H200", "sm_90a")
    assert tuning.lookup(key) == dataclasses.asdict(want)
    assert row["speedup"] == pytest.approx(1.0 / again[lucky] if confirmed else 1.0)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 9, 12])
def test_turns_give_each_contender_new_neighbours(n):
    """Benchmarks time their contenders in turns; a plain rotation puts each one right after the
    same peer every round (whose power draw sets the clock it starts at). Each round must be a
    permutation, no contender may follow the same peer in every round, and the first place moves."""
    orders = tuning.turn_orders(n, 3)
    assert all(sorted(o) == list(range(n)) for o in orders)
    seq = [k for o in orders for k in o]
    for k in range(n):
        preds = [seq[i - 1] for i in range(1, len(seq)) if seq[i] == k]
        assert len(set(preds)) > 1, (k, orders)
    assert len({o[0] for o in orders}) == min(n, 3)
    # and in_turns times every contender once per round, in those orders
    calls = []
    times = tuning.in_turns({f"c{i}": i for i in range(n)}, lambda i: calls.append(i) or float(i), 3)
    assert calls == seq and times == {f"c{i}": float(i) for i in range(n)}
    # log: every timing, in the order it ran, with its round
    log = []
    tuning.in_turns({f"c{i}": i for i in range(n)}, lambda i: float(i), 3, log)
    assert log == [(f"c{k}", r, float(k)) for r, o in enumerate(orders) for k in o]


def test_gemm_entries_tuned_before_the_two_cta_fields_still_apply():
    from tilelang_ops.kernels.gemm import GemmConfig

    old = {"block_M": 128, "block_N": 128, "block_K": 64, "num_stages": 4, "threads": 256, "swizzle": 8, "policy": "Square"}
    cfg = tuning.config_from(GemmConfig, old, GemmConfig())
    assert cfg == GemmConfig(128, 128, 64, 4, 256, 8, "Square") and cfg.min_blocks == 0


def test_corrupted_tuned_file_warns_once_and_is_rebuilt(tuned_dir):
    path = tuning.tuned_path()
    path.write_text('{"format": "tilelang_ops.tuned-configs.v1", "entr')  # truncated
    with pytest.warns(UserWarning, match="corrupted"):
        assert tuning.lookup("x") is None
    tuning.store("x", {"block": 1024})
    assert json.loads(path.read_text())["entries"]["x"]["config"] == {"block": 1024}


def test_cache_cli_info_and_clear(tuned_dir, capsys):
    tuning.store("k", {"block": 1024})
    assert cli.main(["cache", "info"]) == 0
    assert "1 entries" in capsys.readouterr().out
    assert cli.main(["cache", "clear", "tuned"]) == 0
    assert not tuning.tuned_path().exists()


def test_tune_cli_times_each_config_and_prints_the_table(tuned_dir, monkeypatch, capsys):
    # the command as a GPU host runs it, less the GPU: the clock and the runners are stand-ins,
    # so a config's "time" is its block size and the smallest block must win and be stored
    import torch

    from tilelang_ops.ops import TUNABLES

    add = TUNABLES["add"]
    timed = []

    def clock(fn, warm_ms=0.0):
        assert warm_ms >= 100.0  # cli._tune_clock warms each config first
        timed.append(fn())
        return float(fn())

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in GPU")
    monkeypatch.setattr("tilelang_ops.runtime.arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(tuning, "time_cuda", clock)
    add = dataclasses.replace(add, runner=lambda cfg, shape, dtype, device: (lambda: cfg.block))
    monkeypatch.setitem(TUNABLES, "add", add)
    shapes = tuned_dir / "shapes.json"
    shapes.write_text(json.dumps({"add": [[1 << 20], [1 << 26]]}))
    assert cli.main(["tune", "--shapes", str(shapes)]) == 0  # no --op: the ops the file names
    space = add.search_space((1 << 20,), add.dtypes[0])
    assert len(timed) >= 2 * len(space)
    out = capsys.readouterr().out
    best = min(space, key=lambda c: c.block)
    assert "best config" in out and f"stored in {tuning.tuned_path()}" in out
    assert "tuned: add  1048576" in out  # the shape's row as soon as it is stored
    # a short and a long call are two buckets: the second shape's result does not overwrite the first's
    entries = tuning.entries(reload=True)
    assert sorted(e["shape"] for e in entries.values()) == [[1 << 20], [1 << 26]]
    assert all(e["config"] == dataclasses.asdict(best) for e in entries.values())


def _spawn(code: str, env: dict, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


COMPILE_AND_STORE = """
import sys
from tilelang_ops.kernels import elementwise as K
from tilelang_ops import tuning
for dtype in ("float16", "bfloat16"):
    src = K.add_kernel.source(K.AddConfig(512, 128), "sm_90a", dtype=dtype)
tuning.store("writer-" + sys.argv[1], {"block": int(sys.argv[1])})
print(len(src))
"""


@pytest.mark.slow
def test_eight_processes_share_caches_without_corruption(tmp_path):
    env = child_env(TILELANG_CACHE_DIR=str(tmp_path / "tl"), TILEOPS_CACHE_DIR=str(tmp_path / "tuned"))
    procs = [_spawn(COMPILE_AND_STORE, env, str(i)) for i in range(8)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in results), [out[-2000:] for out, _, rc in results if rc]
    assert len({out.splitlines()[-1] for out, _, _ in results}) == 1  # every process produced the same kernel
    entries = json.loads((tmp_path / "tuned" / "tuned_configs.json").read_text())["entries"]
    assert sorted(entries) == sorted(f"writer-{i}" for i in range(8))  # no writer lost
    # a ninth process finds both kernels on disk: nothing compiles, nothing is reported corrupt
    out, err, rc = (lambda p: p.communicate(timeout=600) + (p.returncode,))(_spawn(COMPILE_AND_STORE, env, "8"))
    assert rc == 0 and "begins to compile" not in out and "integrity" not in out, out[-2000:]


@pytest.mark.slow
def test_truncated_kernel_cache_entry_is_reported_and_rebuilt(tmp_path):
    env = child_env(TILELANG_CACHE_DIR=str(tmp_path), TILEOPS_CACHE_DIR=str(tmp_path / "tuned"))
    run = lambda: (lambda p: p.communicate(timeout=600) + (p.returncode,))(_spawn(COMPILE_AND_STORE, env, "0"))
    assert run()[2] == 0
    libs = list(tmp_path.rglob("executable.so"))
    assert len(libs) == 2
    libs[0].write_bytes(libs[0].read_bytes()[:100])  # a crash mid-write, a full disk
    out, _, rc = run()
    assert rc == 0 and "failed integrity verification" in out, out[-2000:]
    out, _, rc = run()  # rebuilt: the next process loads cleanly
    assert rc == 0 and "integrity" not in out and "begins to compile" not in out, out[-2000:]


def test_benchmark_first_run_ends_a_hung_candidate():
    """benchmarks._timing.first_run: a run that does not finish within its timeout ends the process
    with exit code 3 and the candidate's name (a hung kernel must not hold the GPU until the call's
    limit); one that finishes returns normally."""
    code = (
        "import time\nfrom benchmarks._timing import first_run\n"
        "first_run(lambda: None, 'quick', timeout=5, sync=lambda: None)\nprint('quick ok', flush=True)\n"
        "first_run(lambda: time.sleep(30), 'cfg-x', timeout=0.5, sync=lambda: None)\nprint('not reached')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=child_env())
    assert p.returncode == 3, (p.stdout, p.stderr[-1000:])
    assert "quick ok" in p.stdout and "HUNG: cfg-x" in p.stdout and "not reached" not in p.stdout
