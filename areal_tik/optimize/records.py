"""The optimisation IR: typed records of one search run, stored as JSON in a run directory.

Layout of a run directory (every JSON file carries ``schema_version``):

    config.json        RunConfig: op, workload table and its hash, frozen hashes of the
                       evaluator's and the root's sources, the cap, the seed (never rewritten)
    state.json         State: derivation graph, root, best, frontier, archive,
                       opportunities, budget, id counter
    best.json          Best: the incumbent candidate and the audit that promoted it
    events.jsonl       the append-only event log (one JSON object a line, numbered)
    candidates/ID.json Candidate: a config delta or a source module (immutable)
    candidates/ID.py   the source of a source candidate (immutable)
    actions/ID.json    Action: who proposed what, when, at what token cost
    audits/ID.json     Audit: the gate, the anti-hacking checks, paired timing, decision
    lineage/ID.json    Lineage: parent, depth, ancestors and status of a candidate

Every write goes through ``RunDir.locked()`` (an exclusive ``flock`` on ``.lock``,
re-entrant within a process) and lands atomically (temporary file + ``os.replace``), so
concurrent commands serialise and a crash never leaves a half-written record.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


class RunError(ValueError):
    """A run directory that cannot be used as asked (exists, missing, wrong schema, stale)."""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass
class Record:
    """Base of every record: JSON round trip with the schema version checked."""

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict):
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise RunError(f"{cls.__name__}: schema_version {version!r} is not {SCHEMA_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"schema_version"}
        if unknown:
            raise RunError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass
class RunConfig(Record):
    op: str
    grid: str  # workload grid name ("h200", "tiny")
    device: str
    cap: float  # per-workload slowdown cap against the frozen root
    seed: int
    workloads: list  # [{"name", "kind", "params", "coefficient"}]
    workloads_hash: str
    evaluator_hash: str
    evaluator_files: dict  # file -> sha256
    root_hash: str
    root_files: dict  # file -> sha256 of the op's kernel sources
    root_config: dict  # the kernel default the search starts from
    created: str = dataclasses.field(default_factory=now)


@dataclasses.dataclass
class Candidate(Record):
    id: str
    parent: str | None
    kind: str  # "root", "config" (a delta on the parent's config) or "source"
    delta: dict  # config fields changed against the parent (kind "config")
    config: dict  # the full config after the delta (kinds "root" and "config")
    source_hash: str = ""  # sha256 of candidates/ID.py (kind "source")
    proposer: str = "manual"  # "mechanical", "agent", "manual", "root"
    note: str = ""
    created: str = dataclasses.field(default_factory=now)


@dataclasses.dataclass
class Action(Record):
    id: str
    candidate: str
    proposer: str
    note: str = ""
    tokens: int = 0  # LLM tokens spent on this proposal (0: mechanical or by hand)
    created: str = dataclasses.field(default_factory=now)


@dataclasses.dataclass
class Audit(Record):
    id: str
    candidate: str
    incumbent: str
    passed: bool  # gate and anti-hacking checks
    promotable: bool  # passed and the promotion rule holds in this paired run
    reasons: list  # why it failed or is not promotable (empty when promotable)
    checks: dict  # check name -> "ok" or the failure
    workloads: list  # [{"name", "coefficient", "candidate_us", "incumbent_us", "root_us"}]
    t_candidate: float = 0.0
    t_incumbent: float = 0.0
    t_root: float = 0.0
    rounds: int = 0
    device_s: float = 0.0
    evaluator_hash: str = ""
    workloads_hash: str = ""
    created: str = dataclasses.field(default_factory=now)


@dataclasses.dataclass
class Lineage(Record):
    candidate: str
    parent: str | None
    depth: int
    ancestors: list
    status: str = "proposed"  # proposed|eliminated|survivor|failed|passed|promoted|archived
    audits: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)  # e.g. successive-halving scores


@dataclasses.dataclass
class State(Record):
    root: str
    best: str
    graph: dict  # candidate id -> parent id (None for the root)
    frontier: list  # passing candidates not yet expanded or promoted
    archive: list  # former incumbents and passing, non-promoted candidates
    opportunities: list  # [{"note", "workloads", "source"}]: recorded ideas and gaps
    budget: dict  # {"candidates_max", "candidates_used", "device_s_used", "tokens_used"}
    next_id: int = 1


@dataclasses.dataclass
class Best(Record):
    candidate: str
    audit: str | None
    t_best: float
    t_root: float
    speedup: float  # T(root) / T(best) from the promoting audit's paired run
    promoted: str = dataclasses.field(default_factory=now)


_KINDS = {"candidates": Candidate, "actions": Action, "audits": Audit, "lineage": Lineage}
_LOCAL = threading.local()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # No fsync: os.replace already makes the new content appear whole or not at all for
    # every reader; a search writes thousands of small records.
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class RunDir:
    """One run directory: create with ``RunDir.create``, reopen with ``RunDir(path)``."""

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise RunError(f"no optimisation run at {str(self.path)!r} (config.json missing); "
                           f"start one with 'init'")
        self.config = RunConfig.from_json(self._load("config.json"))

    @classmethod
    def create(cls, path, config: RunConfig, root: Candidate) -> "RunDir":
        """Initialise a run; refuses a directory that already holds one (runs resume, never restart)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with cls._flock(path):
            if (path / "config.json").exists():
                raise RunError(f"{str(path)!r} already holds an optimisation run; resume it "
                               f"instead of initialising over it")
            for kind in _KINDS:
                (path / kind).mkdir(exist_ok=True)
            _atomic_write(path / "config.json", json.dumps(config.to_json(), indent=1))
            run = cls(path)
            run.put(root)
            run.put(Lineage(root.id, None, 0, [], status="promoted"))
            run.save_state(State(root=root.id, best=root.id, graph={root.id: None}, frontier=[],
                                 archive=[], opportunities=[],
                                 budget={"candidates_max": 0, "candidates_used": 0,
                                         "device_s_used": 0.0, "tokens_used": 0}))
            run.save_best(Best(root.id, None, 0.0, 0.0, 1.0))
            run.event("init", op=config.op, grid=config.grid, root=root.id)
        return run

    # -------------------------------------------------------------- locking and files

    @staticmethod
    @contextlib.contextmanager
    def _flock(path: Path):
        held = getattr(_LOCAL, "held", {})
        _LOCAL.held = held
        key = str(path.resolve())
        if held.get(key):  # re-entrant inside one thread
            held[key] += 1
            try:
                yield
            finally:
                held[key] -= 1
            return
        with open(path / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            held[key] = 1
            try:
                yield
            finally:
                held[key] = 0
                fcntl.flock(f, fcntl.LOCK_UN)

    def locked(self):
        return self._flock(self.path)

    def _load(self, name: str) -> dict:
        with open(self.path / name) as f:
            return json.load(f)

    # -------------------------------------------------------------- records

    def put(self, record: Record, source: str | None = None) -> None:
        """Store a candidate/action/audit (immutable: an existing id is refused) or a lineage."""
        kind = next(k for k, cls in _KINDS.items() if isinstance(record, cls))
        key = record.candidate if kind == "lineage" else record.id
        path = self.path / kind / f"{key}.json"
        with self.locked():
            if path.exists() and kind != "lineage":
                raise RunError(f"{kind[:-1]} {key!r} exists and records are immutable")
            if source is not None:
                _atomic_write(self.path / kind / f"{key}.py", source)
            _atomic_write(path, json.dumps(record.to_json(), indent=1))

    def get(self, kind: str, key: str) -> Any:
        if kind not in _KINDS:
            raise ValueError(f"record kind must be one of {sorted(_KINDS)}, got {kind!r}")
        path = self.path / kind / f"{key}.json"
        if not path.is_file():
            raise RunError(f"no {kind[:-1]} {key!r} in this run")
        return _KINDS[kind].from_json(self._load(f"{kind}/{key}.json"))

    def all(self, kind: str) -> list:
        return [self.get(kind, p.stem) for p in sorted((self.path / kind).glob("*.json"))]

    def source(self, candidate_id: str) -> str:
        return (self.path / "candidates" / f"{candidate_id}.py").read_text()

    def state(self) -> State:
        return State.from_json(self._load("state.json"))

    def save_state(self, state: State) -> None:
        with self.locked():
            _atomic_write(self.path / "state.json", json.dumps(state.to_json(), indent=1))

    def best(self) -> Best:
        return Best.from_json(self._load("best.json"))

    def save_best(self, best: Best) -> None:
        with self.locked():
            _atomic_write(self.path / "best.json", json.dumps(best.to_json(), indent=1))

    def new_id(self, prefix: str) -> str:
        with self.locked():
            state = self.state()
            key = f"{prefix}{state.next_id:04d}"
            state.next_id += 1
            self.save_state(state)
        return key

    # -------------------------------------------------------------- event log

    def event(self, event_kind: str, **data) -> None:
        """Append one numbered event (never rewritten)."""
        with self.locked():
            log = self.path / "events.jsonl"
            seq = log.read_bytes().count(b"\n") if log.exists() else 0
            with open(log, "a") as f:
                f.write(json.dumps({"seq": seq, "time": now(), "kind": event_kind, **data}) + "\n")

    def events(self) -> list[dict]:
        log = self.path / "events.jsonl"
        return [json.loads(line) for line in open(log)] if log.exists() else []
