"""Per-step token-mask cost of the two grammar libraries megalite could use: xgrammar vs llguidance, on CPU.

Two vocabularies: the 259 ids of megalite's ByteTokenizer (one byte each) and a 32,000-token byte-level
vocabulary (the 256 bytes, then words and word pieces with and without a leading space, digit runs and
punctuation runs taken from the Python standard library's sources: a stand-in for a real BPE vocabulary,
as no hub tokenizer can be fetched here).  For each vocabulary and each grammar (a JSON schema, any JSON,
a regex, an EBNF grammar) a valid output is tokenized greedily (longest match), then each library walks
it: per step, fill the next-token bitmask, then accept the token.  Printed: compile time (median of
``--repeats`` fresh compiles), the median and 99th-percentile per-step mask time, and the ratio of the
medians xgrammar / llguidance.  Then, at the 32k vocabulary, llguidance's JSON mask with megalite's layout (at
most one space between tokens, ``grammar.JSON_LAYOUT``) against pinned ", " / ": " separators, and the compile
time of four large schemas (what a hostile client could send), one compile each.  xgrammar's JSON has no free
whitespace (``any_whitespace=False``).

    python benchmarks/grammar_mask.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["street", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "address", "active"], "additionalProperties": False}
INSTANCE = json.dumps({"name": "Ada Lovelace of the analytical engine", "age": 36, "email": "ada@engine.org",
                       "tags": ["red", "blue", "green"], "address": {"street": "12 St James's Square",
                                                                     "zip": "SW1Y 4JH"}, "active": True})
REGEX = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2})? [A-Z][a-z]+( [A-Z][a-z]+)*"
REGEX_TEXT = "2026-11-25T23:05:17 Grand Central Terminal"
EBNF = ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
        'factor ::= [0-9]+ | "(" expr ")"\n')
EBNF_TEXT = "(12+34)*5-(6/(7+8))*910+(1+2)*(3+4)*(5+6)"


def byte_vocab() -> list[bytes]:
    """megalite's ByteTokenizer: 256 bytes, then eod, pad, bos (specials have no text)."""
    return [bytes([i]) for i in range(256)] + [b"", b"", b""]


def big_vocab(size: int = 32000) -> list[bytes]:
    """256 bytes + the most frequent words, word pieces, digit and punctuation runs of the stdlib sources."""
    counts: dict[bytes, int] = {}
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in sorted(os.listdir(stdlib)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        for piece in re.findall(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]{1,3}|\s+", text):
            raw = piece.encode()
            for cut in (raw, raw[:4], raw[:6]):
                if len(cut) > 1:
                    counts[cut] = counts.get(cut, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    vocab = [bytes([i]) for i in range(256)] + ranked[:size - 257]
    return vocab + [b""]  # the last id: eos


def greedy_tokenize(vocab: list[bytes], text: str) -> list[int]:
    index = {tok: i for i, tok in enumerate(vocab) if tok}
    longest = max(len(t) for t in index)
    raw, out, pos = text.encode(), [], 0
    while pos < len(raw):
        for length in range(min(longest, len(raw) - pos), 0, -1):
            if raw[pos:pos + length] in index:
                out.append(index[raw[pos:pos + length]])
                pos += length
                break
    return out


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes]):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[len(vocab) - 1])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, len(vocab))

    def compile(self, kind: str, source):
        c = self.compiler
        return {"json_schema": lambda: c.compile_json_schema(json.dumps(source), any_whitespace=False),
                "json_object": lambda: c.compile_json_schema('{"type": "object"}', any_whitespace=False),
                "regex": lambda: c.compile_regex(source),
                "ebnf": lambda: c.compile_grammar(source)}[kind]()

    def walk(self, compiled, tokens: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        times = []
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(self.bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token), "xgrammar rejected a valid token"
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: list[bytes]):
        import llguidance
        import llguidance.torch

        class Wrapped:
            eos_token_id, bos_token_id = len(vocab) - 1, None
            tokens = vocab
            special_token_ids = [len(vocab) - 1]

            def __call__(self, text):
                return greedy_tokenize(vocab, text if isinstance(text, str) else text.decode())

        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, len(vocab))

    def compile(self, kind: str, source):
        m = self.ll.LLMatcher
        from megalite.inference.grammar import JSON_LAYOUT as layout
        grammar = {"json_schema": lambda: m.grammar_from_json_schema(source, defaults=layout),
                   "json_object": lambda: m.grammar_from_json_schema({"type": "object"}, defaults=layout),
                   "regex": lambda: m.grammar_from_regex(source),
                   "ebnf": lambda: self.ll.grammar_from("ebnf", source)}[kind]()
        matcher = m(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def walk(self, matcher, tokens: list[int]) -> list[float]:
        times = []
        for token in tokens:
            start = time.perf_counter()
            self.llt.fill_next_token_bitmask(matcher, self.bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(token), matcher.get_error()
        return times


def hostile_schemas() -> dict:
    """Large but legal schemas: many properties with patterns, a long enum, integer-range alternatives, nesting."""
    nested = {"type": "integer"}
    for _ in range(60):
        nested = {"type": "object", "properties": {"a": nested, "b": {"type": "array", "items": {"type": "string"}}},
                  "required": ["a"]}
    return {
        "400 properties": {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": i % 50 + 1}
                                                            for i in range(400)},
                           "required": [f"p{i}" for i in range(400)]},
        "enum of 5000": {"type": "string", "enum": [f"value_{i}_{i * 7919 % 10007}" for i in range(5000)]},
        "300 integer ranges": {"anyOf": [{"type": "object", "properties": {f"k{i}": {
            "type": "integer", "minimum": i, "maximum": i * 1000 + 7}}, "required": [f"k{i}"]} for i in range(300)]},
        "60 levels deep": nested,
    }


def main():
    from extras import require

    require("llguidance", "grammar", "the grammar-library comparison")
    if importlib.util.find_spec("xgrammar") is None:
        print("error: the grammar-library comparison needs xgrammar (pip install xgrammar)", file=sys.stderr)
        sys.exit(2)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cases = [("json_schema", SCHEMA, INSTANCE), ("json_object", None, INSTANCE), ("regex", REGEX, REGEX_TEXT),
             ("ebnf", EBNF, EBNF_TEXT)]
    print(f"{'vocab':>6} {'grammar':>12} {'library':>11} {'compile ms':>11} {'mask us/step':>13} {'p99 us':>8} "
          f"{'steps':>6}")
    for vocab in (byte_vocab(), big_vocab()):
        libs = [XGrammar(vocab), LLGuidance(vocab)]
        for kind, source, text in cases:
            tokens = greedy_tokenize(vocab, text)
            per_step = {}
            for lib in libs:
                compile_ms, steps = [], []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    compiled = lib.compile(kind, source)
                    compile_ms.append((time.perf_counter() - start) * 1e3)
                    steps.extend(lib.walk(compiled, tokens))
                per_step[lib.name] = statistics.median(steps) * 1e6
                p99 = sorted(steps)[int(0.99 * (len(steps) - 1))] * 1e6
                print(f"{len(vocab):>6} {kind:>12} {lib.name:>11} {statistics.median(compile_ms):>11.2f} "
                      f"{per_step[lib.name]:>13.1f} {p99:>8.1f} {len(tokens):>6}")
            print(f"{'':>6} {kind:>12} {'ratio xgr/llg':>11} {'':>11} "
                  f"{per_step['xgrammar'] / per_step['llguidance']:>13.2f}")
    llg = libs[1]
    tokens = greedy_tokenize(vocab, INSTANCE)
    for name, layout in (("megalite's layout", None),
                         ("pinned separators", {"item_separator": ", ", "key_separator": ": ",
                                                "whitespace_flexible": False})):
        grammar = llg.ll.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=layout) if layout else None
        matcher = llg.compile("json_schema", SCHEMA) if layout is None else \
            llg.ll.LLMatcher(llg.tokenizer, grammar, log_level=0)
        step = statistics.median(llg.walk(matcher, tokens)) * 1e6
        print(f"llguidance json_schema mask at {len(vocab)} tokens, {name}: {step:.1f} us/step")
    print(f"\ncompile time of large schemas at {len(vocab)} tokens")
    for name, schema in hostile_schemas().items():
        for lib in libs:
            start = time.perf_counter()
            lib.compile("json_schema", schema)
            print(f"{name:>20} {lib.name:>11} {(time.perf_counter() - start) * 1e3:>10.1f} ms", flush=True)


if __name__ == "__main__":
    main()
