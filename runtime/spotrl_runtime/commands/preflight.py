"""Checks that fail a command before it starts anything: no Ray, no torch, no storage.

Every check is syntactic or a look at the local file system, so a typo costs a second, not
the minute that starting Ray and loading the model take. A failure is a :class:`UsageError`:
the CLI prints its message as one line naming the flag, field or file and what to do, and
exits 2. The flag checks are argparse types, so argparse names the flag.

This module imports only the standard library, yaml, and the torch-free parts of the runtime
(the RLJob model, the datasets' module); a unit test keeps it that way.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
from pathlib import Path
from typing import Any

BUILTIN_MODELS = ("tiny-arith", "tiny-chat", "tiny-agent", "random-100m", "random-0.5b")
"""``spec.policy.model: builtin:<name>``; :data:`spotrl_runtime.models.loading.BUILTIN_MODELS`
(imported there with torch, so named again here; a unit test keeps the two equal)."""
MAX_SECONDS = 3600.0
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")


class UsageError(Exception):
    """Bad input, found before anything started: the message names the flag, field or file and
    what to do. The CLI prints it as one line and exits 2."""


# ------------------------------------------------------------------ flags (argparse types)


def _integer(text: str, low: int, high: int | None, what: str) -> int:
    """``text`` as an integer from ``low`` to ``high`` (None: no bound), else the flag's error."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (``--max-steps``, ``--workers``, ``spotrl worker --num-cpus``)."""
    return _integer(text, 1, None, "an integer >= 1")


def count(text: str) -> int:
    """An integer >= 0 (``spotrl worker --num-gpus``)."""
    return _integer(text, 0, None, "an integer >= 0")


def port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    return _integer(text, 0, 65535, "a port from 0 (any free port) to 65535")


def host_port(text: str) -> str:
    """``HOST:PORT`` with a port from 1 to 65535 (a Ray head's address)."""
    host, sep, port_text = text.rpartition(":")
    if not (sep and host and port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (status.rayHead.address), got {text!r}")
    return text


def seconds(text: str) -> float:
    """A finite number of seconds, above 0 and at most an hour."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0 and at most 3600, got {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: a finite number above 0 and at most 10."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 10):
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most 10, got {text!r}")
    return value


def listen_host(text: str) -> str:
    """An address to listen on: an IP address (0.0.0.0: every interface) or a host name."""
    if is_ip(text) or HOSTNAME.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"must be an IP address (127.0.0.1, or 0.0.0.0 for every interface) or a host name, got {text!r}"
    )


def ip_address(text: str) -> str:
    """An IP address (Ray binds to addresses, not names)."""
    if is_ip(text):
        return text
    raise argparse.ArgumentTypeError(f"must be an IP address, got {text!r}")


def resume(text: str) -> str:
    """``auto``, ``never`` or a cut id (its digits, as `spotrl ckpt list` shows them)."""
    if text in ("auto", "never") or (text.isascii() and text.isdigit()):
        return text
    raise argparse.ArgumentTypeError(
        f"must be auto, never, or a cut id (digits, as `spotrl ckpt list` shows), got {text!r}"
    )


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if DEVICE.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def check_listeners(http_host: str, http_port: int | None, metrics_host: str, metrics_port: int | None) -> None:
    """The two listeners do not ask for the same address."""
    if http_port is None or metrics_port is None or http_port != metrics_port or http_port == 0:
        return
    anywhere = ("0.0.0.0", "::", "")
    if http_host == metrics_host or http_host in anywhere or metrics_host in anywhere:
        raise UsageError(
            f"--metrics-port {metrics_port}: --http-port listens there too; give each its own port "
            "(/metrics is served on both)"
        )


# ------------------------------------------------------------------ the RLJob file


def yaml_documents(text: str, label: str) -> list[Any]:
    """The non-empty YAML documents of ``text``; a syntax error is a UsageError naming
    ``label``, the line and the column."""
    import yaml

    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"{label}:{where} not valid YAML ({problem})") from None


def load_rljob_file(path: str) -> Any:
    """The one RLJob in the YAML file ``path`` (``-f``), validated as the API server would."""

    from spotrl_runtime.api.rljob import SpecError, parse_rljob

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UsageError(f"-f {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"-f {path}: is a folder; give the RLJob's YAML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"-f {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    docs = yaml_documents(text, f"-f {path}")
    if len(docs) != 1:
        raise UsageError(f"-f {path}: expected one RLJob document, found {len(docs)}")
    try:
        return parse_rljob(docs[0])
    except SpecError as err:
        raise UsageError(f"-f {path}: " + "; ".join(f"{p or 'document'}: {m}" for p, m in err.problems)) from None


# ------------------------------------------------------------------ URIs


def check_storage(uri: str, source: str) -> None:
    """``uri`` (from ``source``: a flag, field or variable) can be a store: a path, ``file://``
    or ``s3://bucket[/prefix]`` with a valid bucket name (the CRD's pattern for
    ``spec.checkpoint.storage``); a local path that exists is a folder."""
    from spotrl_runtime.api.rljob import STORAGE_URI

    if not re.fullmatch(STORAGE_URI, uri):
        raise UsageError(
            f"{source} {uri!r}: not a storage URI; use a path, file:///path or s3://bucket/prefix "
            "(bucket: 3 to 63 lowercase letters, digits, '.' and '-')"
        )
    path = _local_path(uri)
    if path is not None and path.exists() and not path.is_dir():
        raise UsageError(f"{source} {uri!r}: is a file; cuts go to a folder (give a folder, or a new path)")


def check_job_inputs(job: Any, where: str) -> None:
    """``spec.dataset.uri`` and ``spec.policy.model`` name something that can exist: a known
    built-in, an s3:// URI with a valid bucket, or a local path that exists. ``where`` names
    the job in the message (``-f job.yaml``)."""
    try:
        _check_job_inputs(job)
    except UsageError as err:
        raise UsageError(f"{where}: {err}") from None


def check_generation(job: Any, device: str, where: str) -> None:
    """``generation.backend: vllm`` has a vLLM build installed that runs on ``device`` (the
    ``--device`` choice; with ``auto``, whichever build is installed). Reads the installed
    distributions only: nothing heavy is imported before Ray starts."""
    if job.spec.generation.backend != "vllm":
        return
    from spotrl_runtime.vllm_build import vllm_build, vllm_build_problem

    build = vllm_build()
    if device == "auto":
        device = "cuda" if build == "cuda" else "cpu"
    problem = vllm_build_problem(device, build)
    if problem is not None:
        raise UsageError(f"{where}: spec.{problem}")


def _check_job_inputs(job: Any) -> None:
    spec = job.spec
    answers = spec.reward.name != "format_only"
    _check_dataset(spec.dataset, "spec.dataset.uri", answers)
    if spec.validation is not None:
        _check_dataset(spec.validation_dataset(), "spec.validation.dataset", answers)

    model = spec.policy.model
    field = "spec.policy.model"
    if model.startswith("builtin:"):
        if model[len("builtin:") :] not in BUILTIN_MODELS:
            known = ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
            raise UsageError(f"{field} {model!r}: not a built-in model; the built-in models are {known}")
    elif model.startswith("s3://"):
        if _s3_parts(model)[0] is None:
            raise UsageError(f"{field} {model!r}: use s3://bucket/prefix with a valid bucket name")
    elif "://" in model:
        raise UsageError(f"{field} {model!r}: use a local folder, s3://bucket/prefix, a model id or builtin:<name>")
    elif model.startswith(("/", "./", "../", "~")):
        # As the loader reads it: an explicit path must exist (a bare name may be a model id).
        path = Path(model).expanduser()
        if not path.is_dir():
            raise UsageError(f"{field} {model!r}: no such folder; give a Hugging Face model folder")
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise UsageError(
                f"{field} {model!r}: has no config.json; give a Hugging Face model folder (or a PEFT adapter "
                "folder that `spotrl ckpt export` wrote)"
            )


def _check_dataset(dataset: Any, field: str, answers: bool) -> None:
    """``dataset.uri`` names something that can exist, and a local or built-in one opens with the
    fields the job reads; ``field`` names it in the message."""
    uri = dataset.uri
    if uri.startswith("builtin:"):
        _check_dataset_rows(dataset, field, answers)  # a built-in dataset is generated from code: cheap
    elif uri.startswith("s3://"):
        bucket, key = _s3_parts(uri)
        if bucket is None or not key:
            raise UsageError(
                f"{field} {uri!r}: use s3://bucket/path/to/file.jsonl or .parquet (a valid bucket and an object)"
            )
    else:
        path = _local_path(uri)
        if path is None:
            raise UsageError(
                f"{field} {uri!r}: use a JSONL or Parquet path, file:///path, s3://bucket/key or builtin:arithmetic"
            )
        if path.is_dir():
            from spotrl_runtime.data.hf_disk import DICT_FILE, STATE_FILE, is_saved_folder

            if not is_saved_folder(path):
                raise UsageError(
                    f"{field} {uri!r}: is a folder without {STATE_FILE} or {DICT_FILE}; give a JSONL or Parquet "
                    "file, or a folder written by datasets' save_to_disk"
                )
        elif not path.is_file():
            raise UsageError(
                f"{field} {uri!r}: does not exist (from {os.getcwd()}); give the JSONL or Parquet file of prompts, "
                "or a save_to_disk folder"
            )
        _check_dataset_rows(dataset, field, answers)


def _check_dataset_rows(dataset: Any, field: str, answers: bool) -> None:
    """A local or built-in dataset opens, and its first rows hold the fields the job reads (an
    s3:// one is checked by the controller, which downloads it)."""
    from spotrl_runtime.data import DatasetError, check_fields, open_dataset

    try:
        check_fields(open_dataset(dataset), dataset, answers=answers)
    except (DatasetError, ValueError, OSError) as err:
        raise UsageError(f"{field}: {err}") from None


def _s3_parts(uri: str) -> tuple[str | None, str]:
    """(bucket, key) of an s3:// URI; bucket None when it is missing or not a valid name."""
    bucket, _, key = uri[len("s3://") :].partition("/")
    valid = re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket) and ".." not in bucket
    return (bucket if valid else None), key.strip("/")


def _local_path(uri: str) -> Path | None:
    """The path a local URI names; None for any other scheme."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    if "://" in uri:
        return None
    return Path(uri)
