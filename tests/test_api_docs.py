"""help() for users: every public function of jax_ep documents its arguments
and results and carries type hints; classes have their own docstrings; help(remat_policy)
describes jax_ep's policy, not JAX's class."""
from __future__ import annotations

import inspect
import pydoc
import re

import jax
import pytest

import jax_ep

# Known gaps, {public name: why}: none today
PENDING_HINTS = {}
PENDING_ARGS = {}
PENDING_CLASS_DOCS = {}

SECTION = re.compile(r"^\s*(Args|Returns|Raises):\s*$", re.MULTILINE)


def _public(kind):
    return [n for n in jax_ep.__all__ if kind(getattr(jax_ep, n))]


FUNCTIONS = _public(inspect.isfunction)
CLASSES = _public(inspect.isclass)


def _args_section(doc):
    """The text of the docstring's Args section ('' without one)."""
    m = re.search(r"^\s*Args:\s*$(.*?)(?=^\s*(?:Returns|Raises|Yields|Example\w*):\s*$|\Z)", doc,
                  re.MULTILINE | re.DOTALL)
    return m.group(1) if m else ""


def test_the_public_api_has_functions():
    assert len(FUNCTIONS) >= 20 and "dispatch" in FUNCTIONS and "dequantize_fp8" in FUNCTIONS


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_documents_args_and_results(name):
    fn = getattr(jax_ep, name)
    doc = inspect.getdoc(fn) or ""
    assert SECTION.search(doc), f"jax_ep.{name}: no Args / Returns / Raises section:\n{doc}"
    params = [p for p in inspect.signature(fn).parameters]
    if not params:
        return
    args = _args_section(doc)
    assert args, f"jax_ep.{name}{inspect.signature(fn)}: no Args section:\n{doc}"
    missing = {p for p in params if not re.search(rf"(?<![\w.]){p}\s*[:,]", args)}
    missing -= PENDING_ARGS.get(name, set())
    assert not missing, f"jax_ep.{name}: Args do not name {sorted(missing)}:\n{args}"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_has_type_hints(name):
    if name in PENDING_HINTS:
        pytest.skip(PENDING_HINTS[name])
    sig = inspect.signature(getattr(jax_ep, name))
    bare = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert not bare, f"jax_ep.{name}{sig}: parameters without a type hint: {bare}"
    assert sig.return_annotation is not inspect.Signature.empty, \
        f"jax_ep.{name}{sig}: no return type hint"


@pytest.mark.parametrize("name", CLASSES)
def test_class_has_its_own_docstring(name):
    cls = getattr(jax_ep, name)
    doc = cls.__dict__.get("__doc__") or ""
    generated = doc.startswith(f"{name}(")  # NamedTuple's default: the field list
    if name in PENDING_CLASS_DOCS and generated:
        pytest.skip(PENDING_CLASS_DOCS[name])
    assert doc.strip() and not generated, f"jax_ep.{name}: no docstring of its own ({doc!r})"


def test_help_of_remat_policy_describes_jax_ep():
    text = pydoc.render_doc(jax_ep.remat_policy, renderer=pydoc.plaintext)
    head = text[:1500]
    assert "jax_ep" in head and "jax.checkpoint" in head and "dispatch" in head, head
    # still JAX's policy type: jax.checkpoint treats save-only-these-names policies specially
    assert isinstance(jax_ep.remat_policy,
                      type(jax.checkpoint_policies.save_only_these_names()))


def test_remat_policy_saves_only_the_communication_names():
    from jax_ep import remat
    p = jax_ep.remat_policy
    assert p.saveable_names == frozenset({remat.DISPATCH, remat.COMBINE})
    hash(p)  # a static argument of jax.checkpoint
