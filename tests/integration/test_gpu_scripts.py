"""The GPU run scripts' commands are accepted by the CLIs they call, checked here before a lease is spent on them.

A device lease is 15 minutes, start-up included; a flag renamed since a script was written would cost its phase
(and its share of the lease) on the GPU machine. Each script's phases run here with `python3` replaced by a shell
function that records its arguments (so nothing is measured), then every recorded `lstune` command goes through
lstune's own CLI — `train` with `--dry-run`, `bench` with its trials replaced by a recorder (and the trials' device
taken as CUDA, as on the GPU machine) — and every `tools.gpu.bench_ladder` command through that script's parser.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import REPO

GPU = REPO / "tools" / "gpu"
SCRIPTS = ("run_short.sh", "run_next.sh")


def recorded_commands(script: str, tmp_path: Path) -> list[list[str]]:
    """The `python3` command lines `script`'s phases run, in order (each `phase` runs its command directly)."""
    calls = [line.strip() for line in (GPU / script).read_text().splitlines()
             if line.strip().isidentifier()]  # the scripts' bodies: one phase function per line
    assert calls, f"no phase calls found in {script}"
    record = tmp_path / "commands.txt"
    driver = "\n".join([
        f". {shlex.quote(str(GPU / 'phase.sh'))}",
        f". {shlex.quote(str(GPU / 'phases.sh'))}",
        'phase() { shift 2; "$@"; }',  # no timeout(1): it could not run a shell function
        f'python3() {{ printf "%q " "$@" >> {shlex.quote(str(record))}; echo >> {shlex.quote(str(record))}; }}',
        "export -f python3",  # the phases' `bash -c "..."` commands call it too
        "nvidia-smi() { return 1; }",  # no GPU named: full_depth_128k runs as on an H100
        *calls,
    ])
    subprocess.run(["bash", "-c", driver], check=True, cwd=tmp_path, capture_output=True, text=True,
                   env={"PATH": "/usr/bin:/bin", "RES": str(tmp_path / "res"), "HOME": str(tmp_path)})
    return [shlex.split(line) for line in record.read_text().splitlines()]


@pytest.fixture
def stubbed_bench(monkeypatch):
    """`lstune bench` with its trials recorded instead of run, the trials' device taken as CUDA."""
    import lstune.bench.run
    import lstune.cli.bench

    runs = []
    monkeypatch.setattr(lstune.bench.run, "run_bench",
                        lambda config, options, **kwargs: runs.append((config, options)) or "no result")
    monkeypatch.setattr(lstune.cli.bench, "render_summary", lambda result: None)
    monkeypatch.setattr(lstune.cli.bench, "_trial_device", lambda: "cuda")
    return runs


@pytest.fixture
def stubbed_ladder(monkeypatch):
    """tools.gpu.bench_ladder with its subcommands recorded instead of run."""
    import tools.gpu.bench_ladder as ladder

    runs = []
    for name in ("rates", "policy", "ladder", "maxlen", "overlap", "chunks"):
        monkeypatch.setattr(ladder, f"cmd_{name}", lambda args, name=name: runs.append((name, args)))
    return ladder, runs


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_command_of_the_gpu_scripts_is_accepted(script, tmp_path, cli, stubbed_bench, stubbed_ladder):
    ladder, ladder_runs = stubbed_ladder
    commands = recorded_commands(script, tmp_path)
    modules = [argv[1] for argv in commands]
    # The phases as of the third H200 lease: the CUDA tests (two runs of pytest), the full-depth bench, the
    # DeepSpeed bench, the Qwen3 recipe, and bench_ladder's chunks and maxlen; run_next.sh adds the full-depth bench
    # with attention recomputed (issue 33's baseline).
    benches = {"run_short.sh": 2, "run_next.sh": 3}[script]
    assert modules.count("lstune") == benches + 1 and modules.count("pytest") == 2, commands
    assert modules.count("tools.gpu.bench_ladder") == 2, commands
    for argv in commands:
        assert argv[0] == "-m", argv
        if argv[1] == "lstune":
            args = argv[2:] + (["--dry-run"] if argv[2] == "train" else [])
            result = cli(*args)
            assert result.code == 0, (shlex.join(argv), result.err)
        elif argv[1] == "tools.gpu.bench_ladder":
            ladder.main(argv[2:])
        else:
            assert argv[1] == "pytest", argv
            for path in (a for a in argv if a.startswith("tests/") or a.startswith("--ignore=")):
                assert (REPO / path.removeprefix("--ignore=")).exists(), path
    assert len(stubbed_bench) == benches and len(ladder_runs) == 2
    full_depth = [config for config, _ in stubbed_bench if config.data.seq_len == 128 * 1024]
    assert sorted(c.memory.recompute_attention for c in full_depth) == (["auto", "on"] if benches == 3 else ["auto"])
    ds = next(config for config, _ in stubbed_bench if config.parallel.zero_stage == "3")
    assert ds.parallel.offload_optimizer and ds.parallel.offload_params and ds.parallel.offload_ratio == 0.5
    assert ds.model.lora_r == 0 and ds.data.seq_len == 16 * 1024


def test_the_long_step_script_runs_commands_the_clis_accept(tmp_path, cli, stubbed_bench):
    """tools/gpu/run_long.sh (issue 31's full-depth step, started detached): its bench command, with the script's
    defaults put in, goes through `lstune bench`; every test file its pytest names exists."""
    text = (GPU / "run_long.sh").read_text().replace("\\\n", " ")
    bench = next(line for line in text.splitlines() if "-m lstune bench" in line)
    argv = shlex.split(bench.split("exec python3 -m lstune ", 1)[1].split('"', 1)[0]
                       .replace("$MODEL", "llama-3.1-8b").replace("$LEN", "384k").replace("$RES", str(tmp_path)))
    result = cli(*argv)
    assert result.code == 0, (argv, result.err)
    (config, options), = stubbed_bench
    assert config.model.name == "llama-3.1-8b" and config.model.lora_r == 16 and config.data.seq_len == 384 * 1024
    assert options.warmup == 0 and options.steps == 1 and options.trial_timeout == 840
    tests = [word for line in text.splitlines() if "pytest" in line for word in line.split()
             if word.startswith("tests/")]
    assert tests and all((REPO / t).exists() for t in tests), tests
