"""The pinned wheel lists that travel to the GPU image (requirements/gpu-*.txt).

    python3 -m eval.wheels check requirements/gpu-vllm.txt      # every line an exact pin
    python3 -m eval.wheels prune DIR requirements/gpu-vllm.txt  # drop `# prune:` members
    python3 -m eval.wheels forget-origin SITE                   # drop pip's direct_url.json

A list is one exact pin a line (``name==version``, a trailing ``# why`` comment allowed),
plus ``# prune: <dist> <member>`` lines: members of that distribution's wheel that the
GPU run never loads (a member ending in ``/`` drops a folder). ``prune`` rewrites the
wheel without them (and without their RECORD lines), so fewer bytes travel.
"""
from __future__ import annotations

import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9._+!-]*)$")


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class WheelList:
    pins: dict[str, str] = field(default_factory=dict)           # canonical name -> version
    prune: dict[str, list[str]] = field(default_factory=dict)    # canonical name -> members


def parse(text: str, source: str = "<list>") -> WheelList:
    """Pins and prune directives of a requirements list; ValueError names a bad line."""
    out = WheelList()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("# prune:"):
            parts = line[len("# prune:"):].split()
            if len(parts) != 2:
                raise ValueError(f"{source}:{number}: expected '# prune: <dist> <member>', got {raw!r}")
            out.prune.setdefault(canonical(parts[0]), []).append(parts[1])
            continue
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        if match is None:
            raise ValueError(f"{source}:{number}: expected an exact pin 'name==version', got {raw!r}")
        name = canonical(match.group(1))
        if name in out.pins:
            raise ValueError(f"{source}:{number}: {match.group(1)!r} is pinned twice")
        out.pins[name] = match.group(2)
    unknown = sorted(set(out.prune) - set(out.pins))
    if unknown:
        raise ValueError(f"{source}: prune directives for unlisted distributions {unknown}")
    return out


def load(path) -> WheelList:
    path = Path(path)
    return parse(path.read_text(), str(path))


def wheel_name(path: Path) -> str:
    """Canonical distribution name of a wheel file (its name's first field)."""
    return canonical(path.name.split("-", 1)[0])


def prune_wheel(path: Path, members: list[str]) -> list[str]:
    """Rewrite the wheel at ``path`` without ``members``; returns the names removed.
    A member that is not in the wheel is an error (the list is out of date)."""
    def dropped(name: str) -> bool:
        return any(name == m or (m.endswith("/") and name.startswith(m)) for m in members)

    with zipfile.ZipFile(path) as src:
        names = src.namelist()
        missing = [m for m in members if not any(n == m or (m.endswith("/") and n.startswith(m)) for n in names)]
        if missing:
            raise ValueError(f"{path.name}: no members {missing}")
        tmp = path.with_suffix(".pruning")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if dropped(info.filename):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    keep = [r for r in data.decode().splitlines() if not dropped(r.split(",", 1)[0])]
                    data = ("\n".join(keep) + "\n").encode()
                dst.writestr(info, data)
    tmp.replace(path)
    return [n for n in names if dropped(n)]


def prune_dir(folder, wheels: WheelList) -> None:
    for path in sorted(Path(folder).glob("*.whl")):
        members = wheels.prune.get(wheel_name(path))
        if members:
            before = path.stat().st_size
            removed = prune_wheel(path, members)
            print(f"pruned {path.name}: {len(removed)} files, {before / 1e6:.1f} -> "
                  f"{path.stat().st_size / 1e6:.1f} MB")


def forget_origin(site) -> int:
    """Drop pip's ``direct_url.json`` (the local path each wheel was installed from) from every
    ``*.dist-info`` in ``site``, and its RECORD line: a packed site names no build folder and
    the same wheels pack to the same bytes. Returns how many were dropped."""
    dropped = 0
    for record in sorted(Path(site).glob("*.dist-info/RECORD")):
        origin = record.parent / "direct_url.json"
        if not origin.exists():
            continue
        origin.unlink()
        name = f"{record.parent.name}/direct_url.json"
        lines = record.read_text().splitlines()
        record.write_text("".join(f"{r}\n" for r in lines if r.split(",", 1)[0] != name))
        dropped += 1
    return dropped


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "check":
        wheels = load(argv[1])
        print(f"{argv[1]}: {len(wheels.pins)} exact pins, prune rules for {sorted(wheels.prune)}")
    elif len(argv) == 3 and argv[0] == "prune":
        prune_dir(argv[1], load(argv[2]))
    elif len(argv) == 2 and argv[0] == "forget-origin":  # scripts/gpu_wheels.sh, scripts/unpack_carry.sh
        forget_origin(argv[1])
    elif len(argv) == 2 and argv[0] == "pins":  # the pins one a line, for pip
        print("\n".join(f"{n}=={v}" for n, v in load(argv[1]).pins.items()))
    else:
        raise SystemExit("usage: python3 -m eval.wheels check LIST | pins LIST | prune DIR LIST | forget-origin SITE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
