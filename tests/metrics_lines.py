"""What the determinism and resume guarantees compare: metrics.jsonl as written, with the timing
fields (`images_per_second`, `time`) cut out of each line and every other byte kept."""
import json
import re

TIMING_FIELDS = ("images_per_second", "time")  # written out here, not read from cdpjax
_TIMING = re.compile(r', "(?:images_per_second|time)": (?:null|-?[0-9][0-9.eE+-]*)')


def without_timing(text: str) -> str:
    """The file's text with `, "images_per_second": X` and `, "time": X` removed from every line."""
    out = _TIMING.sub("", text)
    for line in out.splitlines():  # nothing of them left, or the comparison would hold too little
        assert not set(json.loads(line)) & set(TIMING_FIELDS), line
    return out
