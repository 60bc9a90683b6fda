"""Bad input fails before anything starts: `spotrl run` and `spotrl controller` as a user runs them.

Each hostile input runs the real CLI in a process whose torch and ray cannot be imported
(stand-ins on PYTHONPATH raise): a check that passed its input on to the heavy code would
end in that ImportError, not in the one-line message naming the flag, field or file.

The processes are forks of one driver per module that imported the CLI, the RLJob model and the
checks once (and nothing heavy: the stand-ins would have stopped it): each run is still a
process of its own, with its own folder, environment, stdout and stderr (file descriptors 1 and
2, so a logging handler's output counts too), at a fork's cost instead of an interpreter
start's and those imports'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from spotrl_runtime.commands import preflight

ROOT = Path(__file__).resolve().parents[2]
POISON = "spotrl test: {} must not be imported before every check passed"
JOB = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())

# Reads one request a line ({"args", "cwd", "env", "stdout", "stderr"}) and answers each with
# {"rc": exit code} after running `spotrl ARGS` in a fork: as `python -m spotrl_runtime.cli`
# would, SystemExit's code, or 1 and the traceback for an exception that escapes.
DRIVER = """
import json, os, sys, traceback
from spotrl_runtime import api, cli
from spotrl_runtime.commands import preflight
cli.build_parser()  # imports the commands
answers = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            try:
                code = cli.main(req["args"])
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\\n")
    answers.flush()
"""


class Driver:
    """The module's driver process: Python with the stand-ins first on its path and the CLI imported."""

    def __init__(self, folder: Path):
        self.poison = folder / "poison"
        for name in ("torch", "ray"):
            (self.poison / name).mkdir(parents=True)
            (self.poison / name / "__init__.py").write_text(f"raise ImportError({POISON.format(name)!r})\n")
        self.environ = {k: v for k, v in os.environ.items() if not k.startswith("SPOTRL_")}
        """This environment, less ours: the driver's, and what each run's starts from."""
        self.environ["PYTHONPATH"] = os.pathsep.join([str(self.poison), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.environ
        )

    def run(self, args: list[str], cwd: Path, env: dict[str, str], out: Path) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        stdout, stderr = out.with_suffix(".out"), out.with_suffix(".err")
        req = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the driver exited ({self.proc.wait()}): did importing the CLI import torch or ray?"
        rc = json.loads(answer)["rc"]
        return subprocess.CompletedProcess(args, rc, stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    d = Driver(tmp_path_factory.mktemp("cli-driver"))
    yield d
    d.close()


class Cli:
    """`spotrl` in a process that cannot import torch or ray, in a fresh folder (``work``);
    after each run, no Ray folder and no storage exist."""

    def __init__(self, driver: Driver, tmp_path: Path):
        self.driver = driver
        self.ray_tmp = tmp_path / "ray"
        self.ray_tmp.mkdir()
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.cache = tmp_path / "cache"
        self.runs = 0

    def __call__(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        environ = dict(self.driver.environ)
        environ.update(
            SPOTRL_RAY_TMP=str(self.ray_tmp),
            RAY_TMPDIR=str(self.ray_tmp),
            SPOTRL_CACHE=str(self.cache),
            **env,
        )
        self.runs += 1
        out = self.driver.run(list(args), self.work, environ, self.ray_tmp.parent / f"run-{self.runs}")
        assert not any(self.ray_tmp.iterdir()), "Ray started"
        assert not (self.work / "spotrl-runs").exists(), "storage was touched"
        return out


@pytest.fixture
def cli(driver: Driver, tmp_path: Path) -> Cli:
    return Cli(driver, tmp_path)


def job_file(folder: Path, **changes: object) -> Path:
    """examples/tiny-cpu.yaml with ``changes`` ("spec.dataset.uri": ...) applied."""
    doc = yaml.safe_load(yaml.safe_dump(JOB))
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = doc
        for p in parents:
            node = node[p]
        node[leaf] = value
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def assert_refused(out: subprocess.CompletedProcess[str], names: str) -> None:
    """Exit 2, one line on stderr naming the problem, no traceback, nothing on stdout."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "must not be imported" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert names in lines[0], lines[0]
    assert out.stdout == ""


EXAMPLE = str(ROOT / "examples/tiny-cpu.yaml")


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--max-steps", "-3"], "argument --max-steps: must be an integer >= 1, got '-3'"),
        (["--max-steps", "0"], "argument --max-steps: must be an integer >= 1, got '0'"),
        (["--max-steps", "ten"], "argument --max-steps: must be an integer >= 1"),
        (["--workers", "0"], "argument --workers: must be an integer >= 1"),
        (["--workers", "5000"], "--workers 5000: Input should be less than or equal to 1024"),
        (["--sigterm-deadline", "nan"], "argument --sigterm-deadline: must be a number of seconds above 0"),
        (["--sigterm-deadline", "inf"], "argument --sigterm-deadline"),
        (["--sigterm-deadline", "-1"], "argument --sigterm-deadline"),
        (["--http-port", "70000"], "argument --http-port: must be a port from 0"),
        (["--http-port", "-1"], "argument --http-port"),
        (["--metrics-port", "http"], "argument --metrics-port"),
        (["--http-host", "not a host"], "argument --http-host: must be an IP address"),
        (["--resume", "../../etc"], "argument --resume: must be auto, never, or a cut id"),
        (["--device", "tpu"], "argument --device: must be auto, cpu, cuda or cuda:N"),
        (["--host", "10.0.0.1"], "--host: applies only with --worker-nodes"),
        (["--worker-nodes", "--host", "my-laptop"], "argument --host: must be an IP address"),
        (["--storage", "s3:/x"], "--storage 's3:/x': not a storage URI"),
        (["--storage", "ftp://x"], "--storage 'ftp://x': not a storage URI"),
        (["--storage", "s3://"], "--storage 's3://': not a storage URI"),
        (["--storage", "s3://Bad_Bucket/x"], "not a storage URI"),
        (["--storage", ""], "--storage '': not a storage URI"),
        (["--summary-json", "/nonexistent/folder/summary.json"], "--summary-json /nonexistent/folder/summary.json"),
        (["--http-port", "8123", "--metrics-port", "8123"], "--metrics-port 8123: --http-port listens there too"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_bad_flag_fails_before_anything_starts(cli: Cli, args: list[str], names: str) -> None:
    assert_refused(cli("run", "-f", EXAMPLE, *args), names)


def test_storage_that_is_a_file_is_refused(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    assert_refused(cli("run", "-f", EXAMPLE, "--storage", str(tmp_path / "a-file")), "is a file; cuts go to a folder")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("apiVersion: spotrl.dev/v1alpha1\nkind: [RLJob\n", "-f job.yaml: line 3, column 1: not valid YAML"),
        ("a: b: c\n", "-f job.yaml: line 1, column 5: not valid YAML"),
        ("", "-f job.yaml: expected one RLJob document, found 0"),
        ("a: 1\n---\nb: 2\n", "-f job.yaml: expected one RLJob document, found 2"),
        ("- 1\n", "-f job.yaml: document: an RLJob document must be a mapping"),
    ],
)
def test_a_file_that_is_not_one_rljob_is_one_line(cli: Cli, text: str, names: str) -> None:
    (cli.work / "job.yaml").write_text(text)
    assert_refused(cli("run", "-f", "job.yaml"), names)


def test_a_missing_file_or_a_folder_is_one_line(cli: Cli) -> None:
    assert_refused(cli("run", "-f", "missing.yaml"), "-f missing.yaml: no such file")
    assert_refused(cli("run", "-f", "."), "-f .: is a folder")


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"metadata__name": "../../tmp/x"}, "metadata.name: '../../tmp/x' is not a valid name"),
        ({"metadata__name": "Tiny_Job"}, "metadata.name: 'Tiny_Job' is not a valid name"),
        ({"metadata__name": "a" * 254}, "is not a valid name: use at most 253"),
        ({"metadata__name": 7}, "metadata.name: 7 is not a valid name"),
        ({"spec__generation__groupSize": 1}, "spec.generation.groupSize: Input should be greater than or equal to 2"),
        ({"spec__checkpoint__storage": "ftp://x"}, "spec.checkpoint.storage: String should match pattern"),
        ({"spec__dataset__uri": "./missing.jsonl"}, "spec.dataset.uri './missing.jsonl': does not exist"),
        ({"spec__dataset__uri": "/"}, "spec.dataset.uri '/': is a folder without state.json or dataset_dict.json"),
        ({"spec__dataset__uri": "s3://"}, "spec.dataset.uri 's3://': use s3://bucket/path/to/file.jsonl"),
        ({"spec__dataset__uri": "s3://bucket"}, "spec.dataset.uri 's3://bucket': use s3://bucket/path/to/file.jsonl"),
        (
            {"spec__dataset__uri": "ftp://host/x.jsonl"},
            "spec.dataset.uri 'ftp://host/x.jsonl': use a JSONL or Parquet path",
        ),
        ({"spec__dataset__uri": "builtin:nope"}, "spec.dataset.uri: unknown built-in dataset 'builtin:nope'"),
        ({"spec__dataset__uri": "builtin:arithmetic?size=x"}, "spec.dataset.uri: 'builtin:arithmetic?size=x': size"),
        (
            {"spec__validation": {"dataset": "./held-out.jsonl"}},
            "spec.validation.dataset './held-out.jsonl': does not exist",
        ),
        ({"spec__validation": {"dataset": "builtin:arithmetic", "split": "dev"}}, "spec.validation.dataset: "),
        ({"spec__policy__model": "builtin:huge"}, "spec.policy.model 'builtin:huge': not a built-in model"),
        ({"spec__policy__model": "./no-model"}, "spec.policy.model './no-model': no such folder"),
        ({"spec__policy__model": "s3://B/x"}, "spec.policy.model 's3://B/x': use s3://bucket/prefix"),
        ({"spec__policy__model": "gs://b/x"}, "spec.policy.model 'gs://b/x': use a local folder"),
    ],
)
def test_a_bad_field_fails_before_anything_starts(cli: Cli, changes: dict[str, object], names: str) -> None:
    path = job_file(cli.work, **changes)
    out = cli("run", "-f", str(path))
    assert_refused(out, names)
    assert out.stderr.startswith(f"spotrl run: -f {path}: ")


@pytest.mark.parametrize(
    ("rows", "reward", "names"),
    [
        ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}], "arithmetic_exact", "row idx 1 has no 'answer'"),
        ([{"prompt": "1+1=", "answer": "2"}] * 3 + [{"question": "2+2=", "answer": "4"}], "format_only", "row idx 3"),
    ],
)
def test_a_dataset_row_without_the_fields_the_job_reads_is_refused(
    cli: Cli, rows: list[dict[str, str]], reward: str, names: str
) -> None:
    """Without its answer every reward would be 0 and the run would train nothing, silently."""
    (cli.work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = job_file(cli.work, spec__dataset__uri="rows.jsonl", spec__reward__name=reward)
    out = cli("run", "-f", str(job))
    assert_refused(out, names)
    assert "spec.dataset." in out.stderr
    assert ("answerField" if reward != "format_only" else "promptField") in out.stderr


def test_a_vllm_job_on_a_device_its_build_cannot_serve_is_refused(cli: Cli) -> None:
    """The installed vLLM is read from its distribution, before torch: the CPU build cannot serve
    --device cuda, the CUDA build cannot serve --device cpu, and no build serves either."""
    from spotrl_runtime.vllm_build import vllm_build

    build = vllm_build()
    device = "cuda" if build == "cpu" else "cpu"
    path = job_file(cli.work, spec__generation__backend="vllm")
    out = cli("run", "-f", str(path), "--device", device)
    assert_refused(out, f"-f {path}: spec.generation.backend 'vllm'")
    if build is not None:
        assert "the vLLM installed is its" in out.stderr


def test_a_job_that_passes_the_checks_reaches_the_heavy_code(cli: Cli) -> None:
    """The stand-in torch is what stops this one: the checks let it through, and an unexpected
    error is one line too (exit 1); --debug adds the traceback."""
    out = cli("run", "-f", EXAMPLE)
    assert out.returncode == 1, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("spotrl run: unexpected error: ImportError: spotrl test: torch must not be imported")
    assert line.endswith("(run `spotrl --debug run ...` for the traceback)")

    out = cli("run", "-f", EXAMPLE, "--debug")
    assert out.returncode == 1
    assert out.stderr.startswith("Traceback (most recent call last):")
    assert out.stderr.splitlines()[-1].startswith("spotrl run: unexpected error: ImportError")


def test_debug_shows_the_traceback_of_a_usage_error(cli: Cli) -> None:
    out = cli("--debug", "run", "-f", "missing.yaml")
    assert out.returncode == 2
    assert "Traceback" in out.stderr
    assert out.stderr.splitlines()[-1] == "spotrl run: -f missing.yaml: no such file"


CONTROLLER_ENV = {"SPOTRL_JOB": "tiny", "SPOTRL_ATTEMPT": "1", "SPOTRL_STORAGE": "s3://bucket/tiny"}


@pytest.mark.parametrize(
    ("env", "args", "names"),
    [
        ({"SPOTRL_JOB": ""}, [], "$SPOTRL_JOB is not set"),
        ({"SPOTRL_ATTEMPT": "one"}, [], "$SPOTRL_ATTEMPT='one': must be an integer >= 1"),
        ({"SPOTRL_ATTEMPT": "0"}, [], "$SPOTRL_ATTEMPT='0'"),
        ({"SPOTRL_STORAGE": "s3:/bucket"}, [], "$SPOTRL_STORAGE 's3:/bucket': not a storage URI"),
        ({"SPOTRL_POD_IP": "pod"}, [], "$SPOTRL_POD_IP='pod': must be an IP address"),
        ({}, ["--http-port", "99999"], "argument --http-port"),
        ({}, ["--sigterm-deadline", "0"], "argument --sigterm-deadline"),
        ({}, ["--http-host", "0.0.0.0", "--http-port", "9400"], "--metrics-port 9400: --http-port listens there"),
    ],
)
def test_the_controller_checks_its_flags_and_environment_first(
    cli: Cli, env: dict[str, str], args: list[str], names: str
) -> None:
    out = cli("controller", *args, **{**CONTROLLER_ENV, **env})
    assert_refused(out, names)


def test_the_builtin_models_are_the_loaders() -> None:
    from spotrl_runtime.models.loading import BUILTIN_MODELS

    assert preflight.BUILTIN_MODELS == BUILTIN_MODELS
