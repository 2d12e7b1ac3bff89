"""Reading a run's metrics as the guarantees compare them: metrics.jsonl as written with the timing
fields (`images_per_second` or `tokens_per_second`, `time`) cut out of each line and every other
byte kept, and the TensorBoard events read back with TensorBoard's own reader."""
import json
import re

TIMING_FIELDS = ("images_per_second", "tokens_per_second", "time")  # written out here, not read from cdpjax
_TIMING = re.compile(r', "(?:images_per_second|tokens_per_second|time)": (?:null|-?[0-9][0-9.eE+-]*)')


def without_timing(text: str) -> str:
    """The file's text with `, "images_per_second": X` and `, "time": X` removed from every line."""
    out = _TIMING.sub("", text)
    for line in out.splitlines():  # nothing of them left, or the comparison would hold too little
        assert not set(json.loads(line)) & set(TIMING_FIELDS), line
    return out


def events_of(workdir) -> dict:
    """{tag: [(step, value), ...]} of the TensorBoard events in WORKDIR, read with TensorBoard's
    own event reader (not cdpjax's writer)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(workdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_events(text: str) -> dict:
    """What the events must hold for a metrics.jsonl: each numeric field but `step` and `time`
    of each line, tagged `<split>/<field>`, as float32 (TensorBoard's scalar type)."""
    import numpy as np

    out = {}
    for line in text.splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key not in ("step", "split", "time") and value is not None:
                out.setdefault(f"{record['split']}/{key}", []).append((record["step"], float(np.float32(value))))
    return out
