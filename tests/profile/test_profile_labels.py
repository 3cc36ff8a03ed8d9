"""The profile's labels come from the code itself (``nextn_graph/labels.py``), read by
``profile/kinds.py``: every op of a V4-Flash round gets one, a labelled function or
class keeps its label under another name or in another file, and code that declares
nothing leaves its ops to the caller, or to ``other``."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.kernels.select import projected_kernels
from nextn_graph.labels import LABELS, OTHER, labelled
from nextn_graph.model.ops import use_kernels
from nextn_graph.profile import ProfileSettings
from nextn_graph.profile.build import build_config, count_round, decode_round, profile_models
from nextn_graph.profile.counter import WorkCounter
from nextn_graph.profile.kinds import KindResolver

TOY = '''
import torch
from nextn_graph.labels import DEFER, MOE_GATE, NORM, labelled

class {module}(torch.nn.Module):
    profile_label = NORM
    def {method}(self, x):
        return x * 2

class {deferring}(torch.nn.Module):
    profile_label = DEFER
    def forward(self, x):
        return x - 1

@labelled(MOE_GATE)
def {function}(x, deferring):
    y = (lambda: x + 1)()  # nested: the enclosing function's
    return deferring(y)

def {helper}(x):
    return x.neg()
'''


def _toy(path: str, source: str, **names: str) -> types.ModuleType:
    """``source`` (with ``names`` filled in) as a module whose file is ``path``."""
    module = types.ModuleType(path.rsplit("/", 1)[-1].removesuffix(".py"))
    module.__file__ = path
    exec(compile(source.format(**names), path, "exec"), module.__dict__)
    return module


def _labels_of(run) -> dict[str, str]:
    """op -> label of the ops ``run()`` dispatches (each op at most one label here)."""
    counter = WorkCounter(KindResolver())
    with counter:
        run()
    out: dict[str, str] = {}
    for (_, label, op, *_), _n in counter.work.items():
        assert out.setdefault(op, label) == label, (op, counter.work)
    return out


@pytest.mark.parametrize("path,names", [
    ("/toys/first.py", dict(module="Scale", method="forward", deferring="Shift",
                            function="gate_scores", helper="negate")),
    ("/elsewhere/renamed.py", dict(module="Doubler", method="twice", deferring="Minus",
                                   function="renamed_scores", helper="flip")),
], ids=["named", "renamed-and-moved"])
def test_labels_follow_the_declarations_not_the_names(path, names):
    """The same toy code under other names in another file: every op keeps its label;
    a DEFER class takes its caller's, code declaring nothing its caller's or ``other``."""
    toy = _toy(path, TOY, **names)
    module, deferring = getattr(toy, names["module"])(), getattr(toy, names["deferring"])()
    x = torch.ones(4, device="meta")

    def run():
        getattr(module, names["method"])(x)
        getattr(toy, names["function"])(x, deferring)
        getattr(toy, names["helper"])(x)  # called from this test: no label anywhere
        x.abs()
    assert _labels_of(run) == {"aten.mul": "norm", "aten.add": "moe_gate",
                               "aten.sub": "moe_gate", "aten.neg": OTHER, "aten.abs": OTHER}


def test_a_module_constant_labels_the_code_of_its_own_file():
    """``profile_label`` at module level covers the file's functions and classes that
    declare nothing; code another file put in the module's namespace (as ``dataclass``
    generates its methods) defers."""
    toy = _toy("/toys/cache.py", '''
import torch
from nextn_graph.labels import KV_CACHE, NORM
profile_label = KV_CACHE
def write(x):
    return x + 1
class Rows:
    def read(self, x):
        return x * 2
class Norm:
    profile_label = NORM
    def __call__(self, x):
        return x - 1
''')
    exec(compile("def injected(x):\n    return x.neg()\n", "<generated>", "exec"), toy.__dict__)
    x = torch.ones(4, device="meta")

    def run():
        toy.write(x)
        toy.Rows().read(x)
        toy.Norm()(x)
        toy.injected(x)
    assert _labels_of(run) == {"aten.add": "kv_cache", "aten.mul": "kv_cache",
                               "aten.sub": "norm", "aten.neg": OTHER}


def test_an_unknown_label_is_refused_naming_it():
    with pytest.raises(ValueError, match="'atention'.*not one of"):
        labelled("atention")
    toy = _toy("/toys/typo.py", '''
class Typo:
    profile_label = "atention"
    def forward(self, x):
        return x * 2
''')
    with pytest.raises(ValueError, match=r"Typo\.forward \(/toys/typo\.py\).*'atention'"):
        _labels_of(lambda: toy.Typo().forward(torch.ones(4, device="meta")))


@pytest.mark.parametrize("weights", ["dequantized",
                                     pytest.param("quantized", marks=pytest.mark.heavy)])
def test_every_op_of_a_v4_flash_round_is_labelled(weights):
    """Bucket 1, the reference and the h200's (Triton) kernel sets on one build: no op is
    ``other``, and every label of the vocabulary occurs (a build 5-8 s, a count under 1 s)."""
    st = ProfileSettings(bucket=1, weights=weights)
    models = profile_models(build_config(preset_config("v4-flash"), st.max_context),
                            st.weights, st.dtype)
    for setting in ("reference", "auto"):
        for model in (models.target, models.draft):
            use_kernels(model, projected_kernels(setting, "cuda"))
        counter = WorkCounter(KindResolver(), memo=True)
        count_round(decode_round(models, dataclasses.replace(st, kernels=setting)),
                    st.bucket, counter)
        labels = {label for (_, label, *_) in counter.work}
        assert labels == set(LABELS), (setting, sorted(labels))


def test_the_indexers_top_k_is_the_indexers_in_every_kernel_set():
    """The reference's ``stable_topk`` (a helper of compressor.py the indexer calls) is
    the indexer's, as the fused ``index_topk`` is; file rules made it the compressor's."""
    st = ProfileSettings(bucket=2, max_requests=4, max_context=64, kernels="reference")
    models = profile_models(build_config(preset_config("tiny"), st.max_context),
                            st.weights, st.dtype)
    counter = WorkCounter(KindResolver(), memo=True)
    count_round(decode_round(models, st), st.bucket, counter)
    topk = {label for (_, label, op, *_) in counter.work if op == "aten.topk"}
    assert "indexer" in topk and "compressor" not in topk, topk
