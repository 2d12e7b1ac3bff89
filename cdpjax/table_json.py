"""What `TimeTable.from_json` accepts: the fields `TimeTable.to_json` writes, each checked, the
sizes bounded. A file given to `cdpjax schedule --from-json` may be anything (empty, cut
short, binary, a list, NaN, a device numbered 1e9): `table_fields` turns it into the
keyword arguments of a `TimeTable`, or raises a ConfigError naming the first field that is
not what a table holds, before any table is built. Pure Python, no JAX.

The bounds are those of a table that can still be printed, drawn and held: up to
`SIZE_LIMIT` workers, stages, devices and micro-batches, `TICK_LIMIT` ticks, `CELL_LIMIT`
grid cells (ticks x devices), `RECORD_LIMIT` ops, updates, messages or applies, and `JSON_LIMIT`
bytes of text.
"""
from __future__ import annotations

import dataclasses
import json

from cdpjax.errors import ConfigError
from cdpjax.kinds import KINDS
from cdpjax.timetable import AXES, Apply, Message, Op, Update

JSON_LIMIT = 256 * 2**20
SIZE_LIMIT = 4096
TICK_LIMIT = 10**6
CELL_LIMIT = 10**7
RECORD_LIMIT = 5 * 10**6
COUNT_LIMIT = 10**9  # steps, micro-batches, versions: any count a laid-out table can hold
SLOTS = ("current", "previous", "future", "older")  # future: a read of an update not complete yet (cdp.py,
# simulated); older: two or more versions behind the newest complete (delays.py, simulated)
MESSAGE_KINDS = ("partial", "sum", "allreduce", "param")  # `cdpjax.timetable.Message`
NAME_LIMIT = 10_000  # characters of a method's name, a note or a meta string
_FIX = "write one with TimeTable.to_json or `cdpjax schedule --json`"


def _wrong(what: str) -> ConfigError:
    return ConfigError(f"not a cdpjax time table: {what}; {_FIX}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number a table holds")


def parse(data) -> dict:
    """The JSON object of a table (text, bytes or an already parsed dict)."""
    if isinstance(data, (str, bytes)):
        if len(data) > JSON_LIMIT:
            raise _wrong(f"{len(data)} bytes of JSON, more than {JSON_LIMIT}")
        try:
            data = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise _wrong(f"not JSON ({' '.join(str(e).split())[:120] or type(e).__name__})") from None
    if not isinstance(data, dict):
        raise _wrong(f"a JSON {type(data).__name__}, not an object")
    return dict(data)


def _int(d: dict, name: str, lo: int, hi: int, default=None) -> int:
    v = d.get(name, default)
    if not _is_int(v) or not lo <= v <= hi:
        raise _wrong(f"{name}={v!r} must be an integer in [{lo}, {hi}]")
    return v


def _int_list(d: dict, name: str, lo: int, hi: int, longest: int, default=()) -> list[int]:
    v = d.get(name, list(default))
    if not isinstance(v, list) or len(v) > longest or not all(_is_int(x) and lo <= x <= hi for x in v):
        raise _wrong(f"{name} must be a list of at most {longest} integers in [{lo}, {hi}]")
    return v


def _records(d: dict, name: str, kind, ranges: dict, required: bool = True) -> tuple:
    """A list of `kind` dataclass records: known fields only, the required ones present, every
    field of its declared type (an int within `ranges` where they name it)."""
    rows = d.get(name) if required else d.get(name, [])
    if not isinstance(rows, list) or len(rows) > RECORD_LIMIT:
        raise _wrong(f"{name} must be a list of at most {RECORD_LIMIT} records")
    fields = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(kind)}
    needed = {f.name for f in dataclasses.fields(kind) if f.default is dataclasses.MISSING}
    checks = {"int": lambda k, v: _is_int(v) and ranges.get(k, (0, COUNT_LIMIT))[0] <= v
              <= ranges.get(k, (0, COUNT_LIMIT))[1],
              "bool": lambda k, v: isinstance(v, bool), "str": lambda k, v: isinstance(v, str)}
    out = []
    for i, row in enumerate(rows):
        ok = isinstance(row, dict) and needed <= set(row) and set(row) <= set(fields)
        ok = ok and all(checks[fields[k]](k, v) for k, v in row.items())
        if not ok:
            raise _wrong(f"{name}[{i}] = {json.dumps(row)[:120]} is not a {kind.__name__.lower()} record "
                         f"(fields {', '.join(fields)}, each in range)")
        out.append(kind(**row))
    return tuple(out)


def table_fields(data) -> dict:
    """The keyword arguments of `TimeTable(...)` for a table's JSON (module docstring)."""
    d = parse(data)
    workers, stages = _int(d, "workers", 1, SIZE_LIMIT), _int(d, "stages", 1, SIZE_LIMIT)
    devices, ticks = _int(d, "devices", 1, SIZE_LIMIT), _int(d, "num_ticks", 1, TICK_LIMIT)
    if ticks * devices > CELL_LIMIT:
        raise _wrong(f"num_ticks={ticks} x devices={devices} cells, more than {CELL_LIMIT}")
    ranges = {"tick": (0, ticks - 1), "device": (0, devices - 1), "stage": (0, stages - 1),
              "src": (-1, devices - 1), "dst": (-1, devices - 1), "parts": (1, SIZE_LIMIT),
              "worker": (0, workers - 1)}
    ops = _records(d, "ops", Op, ranges)
    bad = next((o for o in ops if o.kind not in KINDS or o.slot not in SLOTS), None)
    if bad is not None:
        raise _wrong(f"op {dataclasses.asdict(bad)} has kind {bad.kind!r} (kinds: {', '.join(KINDS)}) "
                     f"or slot {bad.slot!r} (slots: {', '.join(SLOTS)})")
    steady = _int_list(d, "steady", 0, ticks, 2, default=[0, ticks])
    if len(steady) != 2 or steady[0] > steady[1]:
        raise _wrong(f"steady={steady} must be [start, stop] with start <= stop")
    notes, keys, method = d.get("notes", []), d.get("meta_keys", []), d.get("method")
    if not isinstance(notes, list) or len(notes) > SIZE_LIMIT or not all(isinstance(n, str) for n in notes):
        raise _wrong("notes must be a list of strings")
    if not isinstance(keys, list) or not all(isinstance(k, str) and k in d for k in keys):
        raise _wrong("meta_keys must list keys present in the table")
    if not isinstance(method, str):
        raise _wrong(f"method={method!r} must be a layout's name")
    axis = d.get("axis", "stage")
    if axis not in AXES:
        raise _wrong(f"axis={axis!r} must be one of {', '.join(AXES)}")
    fields = dict(method=method, axis=axis, workers=workers, stages=stages, steps=_int(d, "steps", 1, COUNT_LIMIT),
                  num_ticks=ticks, devices=devices, period=_int(d, "period", 0, ticks), ops=ops,
                  updates=_records(d, "updates", Update, ranges),
                  messages=_records(d, "messages", Message, ranges, required=False),
                  offsets=tuple(_int_list(d, "offsets", -TICK_LIMIT, TICK_LIMIT, SIZE_LIMIT)),
                  microbatches=_int(d, "microbatches", 1, COUNT_LIMIT, default=1), steady=tuple(steady),
                  meta={k: d[k] for k in keys}, notes=tuple(notes),
                  applies=_records(d, "applies", Apply, ranges, required=False))
    check_references(fields)
    return fields


def _printable(value, where: str, depth: int = 0) -> None:
    """Refuses a string (within lists and objects) that cannot be written out as UTF-8 text (a lone
    surrogate, which JSON's \\ud800 escapes make), that holds control characters other than a
    newline or a tab (a terminal's escapes), or that is longer than `NAME_LIMIT`."""
    if isinstance(value, str):
        if len(value) > NAME_LIMIT or any(ord(c) < 32 and c not in "\n\t" for c in value):
            raise _wrong(f"{where} = {ascii(value)[:60]} is not text of at most {NAME_LIMIT} characters without "
                         f"control characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _wrong(f"{where} = {ascii(value)[:60]} holds a lone surrogate, not text") from None
    elif isinstance(value, (list, dict)) and depth < 64:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            _printable(str(k), f"{where} key", depth + 1)
            _printable(v, f"{where}[{k!r}]", depth + 1)


def check_references(f: dict) -> None:
    """The rules between a table's fields, which each field's own range cannot say: at least one
    op; every op's step below `steps`, its version at most `steps`, its micro-batch below
    max(workers, microbatches); a stale flag only where the workers x stages matrix has a place
    for it (an F op's micro-batch below `workers`), and the same for a (worker, stage) pair at
    every step (the delayed rule is per pair, not per step); every update's and message's step
    below `steps`; a message either point to point (src and dst devices) or an all-reduce (both
    -1), of a known kind; `offsets` empty or one per worker; names and notes printable text."""
    workers, steps = f["workers"], f["steps"]
    if not f["ops"]:
        raise _wrong("ops is empty: a table lays out at least one op")
    micros = max(workers, f["microbatches"])
    for i, op in enumerate(f["ops"]):
        wrong = (f"step={op.step} must be below steps={steps}" if op.step >= steps else
                 f"version={op.version} must be at most steps={steps}" if op.version > steps else
                 f"micro={op.micro} must be below max(workers, microbatches)={micros}" if op.micro >= micros else "")
        if wrong:
            raise _wrong(f"ops[{i}] = {dataclasses.asdict(op)}: {wrong}")
    if any(op.stale for op in f["ops"]):
        rule = {}
        for i, op in enumerate(f["ops"]):
            if not KINDS[op.kind].forward:
                continue
            if op.micro >= workers:
                raise _wrong(f"ops[{i}] = {dataclasses.asdict(op)}: a table with stale ops has a worker x stage "
                             f"rule, and micro={op.micro} is past its workers={workers}")
            if rule.setdefault((op.micro, op.stage), op.stale) != op.stale:
                raise _wrong(f"ops[{i}] = {dataclasses.asdict(op)}: worker {op.micro}'s forward of stage {op.stage} "
                             f"is stale={op.stale} here and stale={not op.stale} at another step; the rule is one "
                             f"per (worker, stage)")
    for name in ("updates", "messages", "applies"):
        bad = next((i for i, r in enumerate(f[name]) if r.step >= steps), None)
        if bad is not None:
            raise _wrong(f"{name}[{bad}] = {dataclasses.asdict(f[name][bad])}: its step must be below steps={steps}")
    for i, m in enumerate(f["messages"]):
        if (m.src < 0) != (m.dst < 0) or m.kind not in MESSAGE_KINDS:
            raise _wrong(f"messages[{i}] = {dataclasses.asdict(m)}: src and dst are both devices or both -1 (an "
                         f"all-reduce), and kind one of {', '.join(MESSAGE_KINDS)}")
    if f["offsets"] and len(f["offsets"]) != workers:
        raise _wrong(f"offsets has {len(f['offsets'])} entries; the table has workers={workers} (or give none)")
    _printable(f["method"], "method")
    _printable(list(f["notes"]), "notes")
    _printable(f["meta"], "meta")


__all__ = ["CELL_LIMIT", "JSON_LIMIT", "MESSAGE_KINDS", "RECORD_LIMIT", "SIZE_LIMIT", "TICK_LIMIT", "check_references",
           "parse", "table_fields"]
