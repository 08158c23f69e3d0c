"""The device key a verdict holds for, the verdict itself, and its on-disk cache."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
from pathlib import Path

import torch
import triton

import areal_tik

CACHE_ENV = "AREAL_TIK_QUALIFY_CACHE"
_FORMAT = 1


# ----------------------------------------------------------------------------- the key


def _driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), "unknown")


def _source_commit() -> str:
    if os.environ.get("AREAL_TIK_COMMIT"):  # set by eval/gpu_session.sh where no .git travels
        return os.environ["AREAL_TIK_COMMIT"]
    root = Path(areal_tik.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    """What the verdict depends on; ``id`` is its stable hash (the cache key)."""

    gpu: str
    sm_count: int
    driver: str
    torch: str
    triton: str
    areal_tik: str

    @property
    def id(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @classmethod
    def of(cls, device: torch.device) -> "DeviceKey":
        version = f"{areal_tik.__version__}+{_source_commit()}"
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return cls(props.name, props.multi_processor_count, f"{_driver_version()} cuda {torch.version.cuda}",
                       torch.__version__, triton.__version__, version)
        interpreter = os.environ.get("TRITON_INTERPRET") == "1"
        return cls("cpu (Triton interpreter)" if interpreter else "cpu", 0, "none", torch.__version__,
                   triton.__version__, version)


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Check:
    op: str
    passed: bool | None  # None: does not apply on this device (stated in ``detail``)
    detail: str


@dataclasses.dataclass
class Verdict:
    key: DeviceKey
    checks: list[Check]
    seconds: float
    cached: bool = False
    compile_seconds: float = 0.0  # of ``seconds``, compiling the probes' kernels ahead (``precompile``)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks) and any(c.passed for c in self.checks)

    @property
    def failing_ops(self) -> list[str]:
        return [c.op for c in self.checks if c.passed is False]

    @property
    def pin_linear(self) -> bool:
        """Advice: linear's table geometry failed here, pin it to one tile (``pin_linear_tile``)."""
        return any(c.op.startswith("linear") and c.passed is False for c in self.checks)

    def message(self) -> str:
        where = f"{self.key.gpu} ({self.key.sm_count} SMs, triton {self.key.triton}, torch {self.key.torch})"
        if self.passed:
            compiled = f", {self.compile_seconds:.1f} s of it compiling" if self.compile_seconds else ""
            return f"device qualification passed on {where} in {self.seconds:.1f} s{compiled}"
        failed = "; ".join(f"{c.op}: {c.detail}" for c in self.checks if c.passed is False)
        return f"device qualification FAILED on {where}: {failed}"

    def to_json(self) -> dict:
        return {"key": dataclasses.asdict(self.key), "seconds": self.seconds, "compile_seconds": self.compile_seconds,
                "checks": [dataclasses.asdict(c) for c in self.checks]}

    @classmethod
    def from_json(cls, data: dict, cached: bool = True) -> "Verdict":
        return cls(DeviceKey(**data["key"]), [Check(**c) for c in data["checks"]], float(data["seconds"]), cached,
                   float(data.get("compile_seconds", 0.0)))


# ----------------------------------------------------------------------------- cache


def cache_path() -> Path:
    """``$AREAL_TIK_QUALIFY_CACHE``, else the user cache dir's ``areal-tik/qualification.json``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "areal-tik" / "qualification.json"


def load_verdicts(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, unreadable or corrupt: probe again and rewrite it
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return {}
    return data.get("verdicts", {})


def store_verdicts(path: Path, verdicts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": _FORMAT, "verdicts": verdicts}, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: concurrent processes never read half a file
