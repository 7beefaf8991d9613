"""A reading of kvf_scheme_canonical() independent of the library, for the tests:
it checks what kvf_scheme_get_info reports, and gives the fields the struct
does not carry (key.group_size, key.mode...).

The canonical text is Lua such as
  return {
    name = "rtn_int2",
    head_dim = 128,
    key = { axis = "channel", bits = 2, ... },
    chunk = { recent = 0, sink = 0, span = 1, tokens = 4680 },
  }
The parser reads Lua table constructors of names, strings, numbers, booleans
and nested tables (arrays too): all the canonical text contains.
"""
from typing import Any

from kvforge.scheme import SchemeInfo


class _CanonicalParser:
    def __init__(self, text: str):
        self.t = text
        self.i = 0

    def error(self, what: str):
        line = self.t.count("\n", 0, self.i) + 1
        return ValueError(f"canonical scheme text, line {line}: {what}")

    def skip(self):
        t = self.t
        while self.i < len(t):
            c = t[self.i]
            if c.isspace():
                self.i += 1
            elif t.startswith("--", self.i):
                j = t.find("\n", self.i)
                self.i = len(t) if j < 0 else j + 1
            else:
                break

    def peek(self) -> str:
        self.skip()
        return self.t[self.i] if self.i < len(self.t) else ""

    def expect(self, s: str):
        self.skip()
        if not self.t.startswith(s, self.i):
            raise self.error(f"expected {s!r}")
        self.i += len(s)

    def name(self) -> str:
        self.skip()
        j = self.i
        while j < len(self.t) and (self.t[j].isalnum() or self.t[j] == "_"):
            j += 1
        if j == self.i:
            raise self.error("expected a name")
        n = self.t[self.i:j]
        self.i = j
        return n

    def value(self) -> Any:
        c = self.peek()
        if c == "{":
            return self.table()
        if c in "\"'":
            q = c
            self.i += 1
            out = []
            while self.i < len(self.t) and self.t[self.i] != q:
                if self.t[self.i] == "\\":
                    self.i += 1
                    esc = self.t[self.i]
                    out.append({"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'"}.get(esc, esc))
                else:
                    out.append(self.t[self.i])
                self.i += 1
            self.expect(q)
            return "".join(out)
        j = self.i
        while j < len(self.t) and (self.t[j].isalnum() or self.t[j] in "._+-"):
            j += 1
        tok = self.t[self.i:j]
        self.i = j
        if tok in ("true", "false"):
            return tok == "true"
        if tok == "nil":
            return None
        try:
            return int(tok, 0)
        except ValueError:
            try:
                return float(tok)
            except ValueError:
                raise self.error(f"unexpected {tok!r}") from None

    def table(self):
        self.expect("{")
        d: dict = {}
        arr: list = []
        while self.peek() != "}":
            save = self.i
            if self.peek().isalpha() or self.peek() == "_":
                n = self.name()
                if self.peek() == "=":
                    self.expect("=")
                    d[n] = self.value()
                else:
                    self.i = save
                    arr.append(self.value())
            elif self.peek() == "[":
                self.expect("[")
                k = self.value()
                self.expect("]")
                self.expect("=")
                d[k] = self.value()
            else:
                arr.append(self.value())
            if self.peek() in (",", ";"):
                self.i += 1
            elif self.peek() != "}":
                raise self.error("expected ',' or '}'")
        self.expect("}")
        if arr and not d:
            return arr
        if arr:
            d.update({i + 1: v for i, v in enumerate(arr)})
        return d

    def parse(self) -> dict:
        self.skip()
        if self.t.startswith("return", self.i):
            self.i += len("return")
        v = self.table()
        if not isinstance(v, dict):
            raise self.error("the scheme is not a table of fields")
        return v


def parse_canonical(text: str) -> dict:
    """Parse a scheme's canonical Lua text into nested dicts."""
    return _CanonicalParser(text).parse()


def info_from_canonical(text: str) -> SchemeInfo:
    c = parse_canonical(text)
    key, value = c.get("key", {}), c.get("value", {})
    rope, chunk = c.get("rope", {}), c.get("chunk", {})
    head_dim = int(c.get("head_dim", 128))
    sections = rope.get("sections")
    if isinstance(sections, dict):  # an empty or mixed table
        sections = [v for k, v in sorted(sections.items()) if isinstance(k, int)]
    sections = tuple(int(s) for s in sections) if sections else (head_dim // 2,)
    return SchemeInfo(
        head_dim=head_dim,
        key_bits=int(key.get("bits", 2)),
        value_bits=int(value.get("bits", 2)),
        chunk_tokens=int(chunk.get("tokens", 4680)),
        chunk_span=int(chunk.get("span", 1)),
        chunk_recent=int(chunk.get("recent", 0)),
        chunk_sink=int(chunk.get("sink", 0)),
        rope_placement=str(rope.get("placement", "none")),
        rope_axes=len(sections),
        psac_rank=int(key.get("psac_rank", 0)),
        key_centroids=int(key.get("centroids", 0)),
        key_qsac_candidates=int(key.get("qsac_candidates", 1)),
        rope_layout=str(rope.get("layout", "half")),
        rope_theta=float(rope.get("theta", 10000.0)),
        rope_sections=sections,
        outliers=(int(c.get("outliers", {}).get("key", 0)), int(c.get("outliers", {}).get("value", 0))),
        mixed_channels=tuple(_refined(float(c.get("mixed_precision", {}).get(f, 0)), head_dim)
                             for f in ("key_fraction", "value_fraction")),
        anchor_every=int(c.get("anchors", {}).get("every", 0)),
        anchor_bits=int(c.get("anchors", {}).get("bits", 0)),
        feedback_decay=float(c.get("error_feedback", {}).get("decay", 0.0)),
    )


def _refined(fraction: float, head_dim: int) -> int:
    """Refined channels a head: the fraction of head_dim in whole groups of 8 (docs/SCHEMES.md)."""
    return int(fraction * head_dim / 8 + 0.5) * 8 if fraction > 0 else 0
