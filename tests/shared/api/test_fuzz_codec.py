"""Fuzzing the one place where untyped YAML/JSON becomes typed objects (draplane.api.codec).

Property: every text is either read, or rejected with a DecodeError whose one line says where and
what; never another exception, never a hang (aliases that expand without bound, nesting deeper than
the recursion limit, integers too long to convert). Counts: see tests/fuzzing.py.
"""

from __future__ import annotations

import copy
import json

import msgspec
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from draplane.api.codec import MAX_ALIAS_EXPANSION, MAX_DEPTH, DecodeError, decode_object, iter_documents, load_objects
from fuzzing import awkward_values, bounded, fuzz, manifests, mutated, render


def read(text: str) -> list[msgspec.Struct]:
    """load_objects, but a DecodeError is an answer too; the property is that nothing else comes out."""
    with bounded():
        try:
            return load_objects([("input.yaml", text)])
        except DecodeError as exc:
            message = str(exc)
            assert message.startswith("input.yaml") and "\n" not in message and "Traceback" not in message
            return []


# YAML's own punctuation, so random text reaches the parser's corners (anchors, tags, flow, blocks).
YAML_ALPHABET = st.sampled_from(list("{}[],:-?&*!|>'\"#%@`\n\t .\\0a1") + ["---", "...", "!!", "<<", "&a ", "*a",
                                                                        "!!binary ", "!!set ", "!!omap ", "!!int ",
                                                                        "!!float ", "!!str ", "kind: ", "items: "])


@fuzz(300)
@given(st.text(max_size=200) | st.lists(YAML_ALPHABET, max_size=60).map("".join))
@example("a: " + "9" * 5000)  # longer than int() converts (sys.set_int_max_str_digits): ValueError
@example("[" * 5000 + "]" * 5000)  # deeper than the composer's recursion: RecursionError
@example("{a: " * 3000 + "1" + "}" * 3000)
@example("&a [*a]")  # a list that contains itself
@example("!!set {a, b}")  # a Python set: not JSON
@example("apiVersion: v1\nkind: Pod\nmetadata: !!binary aGVsbG8=")  # bytes
@example("? [a]\n: 1")  # a key that cannot be hashed
@example("{1: a, true: b, null: c, 1.5: d}")  # keys that are not strings
@example("!!omap [a: 1, b: 2]")
@example("!!float 1e400")
@example("!!int")  # an explicit tag on what it is not: IndexError, ValueError, KeyError in PyYAML
@example("!!bool maybe")
@example("[{kind: [a], apiVersion: v1}]")  # kind of another type: unhashable in the model lookup
@example("{kind: Pod, apiVersion: v1, metadata: {namespace: 1}}")
@example('{"\\ud800\\udc00": 1, "apiVersion": "v1", "kind": "Pod", "metadata": {}}')  # JSON's surrogate pair
def test_random_text_is_read_or_rejected(text):
    read(text)


@fuzz(60)
@given(st.sampled_from(manifests()).flatmap(lambda m: mutated(m, values=awkward_values(binary=False))),
       st.sampled_from(["yaml", "json", "flow"]))
def test_near_valid_manifests_are_read_or_rejected(tree, style):
    try:
        text = render(tree, style)
    except (ValueError, RecursionError):  # json.dumps of NaN keys and the like: no text to read
        return
    assume(len(text) < 300_000)  # huge documents: test_huge_documents_are_read_in_linear_time
    read(text)


@st.composite
def text_edits(draw):
    """A valid manifest's text with a few characters inserted, deleted or replaced."""
    text = render(draw(st.sampled_from(manifests())), draw(st.sampled_from(["yaml", "json"])))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(st.sampled_from(list(":-[]{}&*!|>'\"# \n\t") + ["&x ", "*x", "!!binary ", "<<: *x"]))
        if op == "insert":
            text = text[:at] + piece + text[at:]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 20)):]
        else:
            text = text[:at] + piece + text[at + 1:]
    return text


@fuzz(150)
@given(text_edits())
def test_edited_manifest_text_is_read_or_rejected(text):
    read(text)


def billion_laughs(width: int, depth: int) -> str:
    lines = ["a0: &a0 [lol]"]
    for level in range(1, depth + 1):
        refs = ", ".join([f"*a{level - 1}"] * width)
        lines.append(f"a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


@fuzz(40)
@given(st.integers(2, 12), st.integers(1, 12), st.sampled_from(["plain", "as-field", "in-list"]))
def test_alias_bombs_are_rejected_quickly(width, depth, where):
    """Each level repeats the one below `width` times: width**depth nodes from a few lines."""
    text = billion_laughs(width, depth)
    if where == "as-field":
        text = "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: x}\nspec:\n  " + text.replace("\n", "\n  ")
    elif where == "in-list":
        text = "kind: List\napiVersion: v1\nitems:\n- " + text.replace("\n", "\n  ")
    expanded = sum(width**level for level in range(depth + 1))
    with bounded(10):
        if expanded > MAX_ALIAS_EXPANSION:
            with pytest.raises(DecodeError, match="alias"):
                list(iter_documents(text, source="input.yaml"))
        else:
            read(text)


def test_an_alias_bomb_names_the_document_and_the_limit():
    with pytest.raises(DecodeError) as caught:
        list(iter_documents(billion_laughs(10, 9), source="bomb.yaml"))
    assert str(caught.value).startswith("bomb.yaml: ")
    assert f"{MAX_ALIAS_EXPANSION:,}" in str(caught.value)


def test_modest_aliases_still_work_as_in_kubectl():
    text = """
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: s}
spec:
  driver: gpu.nvidia.com
  nodeName: node-a
  pool: {name: node-a, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    attributes: &attrs
      productName: {string: H100}
  - name: gpu-1
    attributes: *attrs
"""
    (slice_,) = load_objects([("s.yaml", text)])
    assert slice_.spec.devices[1].attributes["productName"].string_value == "H100"


@pytest.mark.parametrize("text, words", [
    ("&a [*a]", "contains itself"),
    ("&a {k: *a}", "contains itself"),
    ("a: &x {b: [1, *x]}", "contains itself"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} levels"),
    ("{a: " * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} levels"),
    ("a: &x " + "[" * 60 + "]" * 60 + "\nb: " + "[" * 60 + "*x" + "]" * 60, "through alias 'x'"),
    ("a: " + "9" * 5000, "integer"),
    ("? [a]\n: 1", "not a sequence"),
    ("? {a: 1}\n: 1", "not a mapping"),
    ("{null: a}", "not null"),
    ('"\\ud800"', "surrogate"),
    ("!!int abc", "not an integer"),
    ("!!float x", "not a number"),
    ("a: 0x" + "f" * 5000, "out of range"),
])
def test_unreadable_structures_are_rejected_by_name(text, words):
    with pytest.raises(DecodeError, match=words):
        with bounded(10):
            list(iter_documents(text, source="input.yaml"))


def test_nesting_at_the_limit_is_read():
    (( _, doc),) = list(iter_documents("[" * MAX_DEPTH + "]" * MAX_DEPTH))
    assert isinstance(doc, list)


@pytest.mark.parametrize("text, value", [
    ("!!set {a, b}", {"a": None, "b": None}),  # a YAML set is a mapping to nulls
    ("!!omap [a: 1, b: 2]", [{"a": 1}, {"b": 2}]),
    ("!!pairs [a: 1, a: 2]", [{"a": 1}, {"a": 2}]),
    ("!!binary aGVsbG8=", "hello"),
    ("{1: a, true: b, n: c, 1.5: d}", {"1": "a", "true": "b", "false": "c", "1.5": "d"}),
    ("!!timestamp 2001-12-14", "2001-12-14"),
    ('{"\\ud83d\\udca5": "\\ud83d\\udca5"}', {"💥": "💥"}),
])
def test_yaml_only_types_become_json_ones(text, value):
    """kubectl turns YAML into JSON before anything reads it: no sets, bytes, tuples or non-string keys."""
    ((_, doc),) = list(iter_documents(text))
    assert doc == value


def test_huge_documents_are_read_in_linear_time():
    """A List of 100 slices (~100 KB, no aliases): slow in pure-Python YAML, but linear."""
    slices = [m for m in manifests() if m["kind"] == "ResourceSlice"]
    items = []
    for i in range(100):
        item = copy.deepcopy(slices[i % len(slices)])
        item["metadata"]["name"] += f"-{i}"
        items.append(item)
    text = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    assert len(text) > 100_000
    with bounded(60):
        assert len(load_objects([("big.json", text)])) == 100


def test_a_document_of_every_kind_decodes():
    for raw in manifests():
        decode_object(raw)
