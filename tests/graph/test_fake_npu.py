"""The fake ``torch.npu`` is no kinder than torch_npu.

It records exactly the ops of torch_npu's graph op handler table
(``updates.TORCH_NPU_HANDLERS``, transcribed from torch_npu's
``_npugraph_handlers``) and applies an update dict as torch_npu's
``update_capture_record`` does: a key naming a recorded kwarg replaces it, a
handler's key replaces its positional slot, every other key is ignored. The ops
here are CPU stand-ins with the overload names and argument layout of the real
kernels (tests/helpers.py), which is all the table looks at.
"""

from __future__ import annotations

import pytest
import torch


from helpers import (IFA_OP, PA_OP, ifa_inputs, ifa_standin, pa_inputs, pa_standin, seqlen_op,
                     define_op)
from fake_npu import make_fake_npu


def _capture(fake, fn, auto: bool = True):
    graph = fake.NPUGraph()
    with fake.graph(graph, pool=fake.graph_pool_handle(), auto_dispatch_capture=auto):
        fn()
    return graph


def _names(graph) -> list[str]:
    return [rec.op_cache_entry.__name__ for rec in graph.graph_dispatch_mode.graph_dispatch_records]


# -- 1. what is recorded ----------------------------------------------------------------

def test_fake_records_exactly_the_ops_of_torch_npus_handler_table():
    """Only table ops are recorded: IFA .default and paged attention .default are; a custom
    host-list op, and an MLA .default (torch_npu registers only MLA .out), are not."""
    ifa, pa, seq = ifa_standin(), pa_standin(), seqlen_op()
    mla = define_op("npu_multi_head_latent_attention",
                      "(Tensor x, Tensor context_lens) -> Tensor",
                      lambda x, context_lens: x * context_lens.sum())
    q, k, v = ifa_inputs()
    query, key_cache, value_cache, table, out = pa_inputs()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    attn = torch.zeros(2, 1, 4)  # a static output buffer, as the engine's

    def fn():
        y = seq(ifa(q, k, v, actual_seq_lengths_kv=[2, 6])[0], [1, 2])
        pa(query, key_cache, value_cache, 1, 1, 0.5, table, lens, out)
        attn.copy_(mla(y, lens))

    graph = _capture(make_fake_npu(), fn)
    assert _names(graph) == [f"{IFA_OP}.default", f"{PA_OP}.default"]
    ifa_rec, pa_rec = graph.graph_dispatch_mode.graph_dispatch_records
    assert len(ifa_rec.args) == 3 and ifa_rec.kwargs == {"actual_seq_lengths_kv": [2, 6]}
    assert len(pa_rec.args) == 9 and pa_rec.args[7] is lens  # context_lens: slot 7
    graph.replay()  # no update: the captured values, as on the device
    assert torch.equal(attn, ifa(q, k, v, actual_seq_lengths_kv=[2, 6])[0] * 3 * 8)


def test_fake_skips_fa3_calls_in_bnsd_layout_as_torch_npu_does():
    """FA v3 is recorded unless its input_layout is BNSD (its handler's should_handle)."""
    fa3 = define_op("npu_fusion_attention_v3",
                      "(Tensor query, Tensor key, Tensor value, int head_num, "
                      "str input_layout) -> Tensor",
                      lambda q, k, v, head_num, input_layout: q + k + v)
    x = torch.ones(2)
    graph = _capture(make_fake_npu(), lambda: (fa3(x, x, x, 1, "BNSD"), fa3(x, x, x, 1, "TND")))
    assert [rec.args[4] for rec in graph.graph_dispatch_mode.graph_dispatch_records] == ["TND"]


# -- 2. what an update applies --------------------------------------------------------------

def test_fake_update_applies_a_recorded_kwarg_by_its_own_name_and_ignores_other_keys():
    """IFA: actual_seq_lengths_kv (a recorded kwarg) lands; a kwarg not passed at capture
    (actual_seq_lengths), a misspelt key and another op's key are ignored silently."""
    ifa = ifa_standin()
    q, k, v = ifa_inputs()
    attn = torch.zeros(2, 1, 4)
    graph = _capture(make_fake_npu(),
                     lambda: attn.copy_(ifa(q, k, v, actual_seq_lengths_kv=[2, 6])[0]))
    captured = ifa(q, k, v, actual_seq_lengths_kv=[2, 6])[0]
    for ignored in ({"actual_seq_lengths": [1, 1]}, {"actual_seq_lens_kv": [1, 1]},
                    {"context_lens": torch.tensor([1, 1], dtype=torch.int32)}):
        graph.update(cpu_update_input=[ignored])
        graph.replay()
        assert torch.equal(attn, captured), ignored
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [5, 1], "bogus": 0}])
    graph.replay()
    assert torch.equal(attn, ifa(q, k, v, actual_seq_lengths_kv=[5, 1])[0])
    assert not torch.equal(attn, captured)
    graph.replay()  # an update holds until the next one, as torch_npu re-records the task
    assert torch.equal(attn, ifa(q, k, v, actual_seq_lengths_kv=[5, 1])[0])


def test_fake_update_applies_a_positional_slot_only_under_its_handlers_key():
    """Paged attention: context_lens reaches slot 7 under the key its handler declares;
    'actual_seq_lengths_kv' (IFA's key) and 'lens' do nothing to it."""
    pa = pa_standin()
    query, key_cache, value_cache, table, out = pa_inputs()
    lens = torch.tensor([8, 8], dtype=torch.int32)  # host data: made before capture
    graph = _capture(make_fake_npu(),
                     lambda: pa(query, key_cache, value_cache, 1, 1, 0.5, table, lens, out))
    captured = out.clone()
    new = torch.tensor([3, 5], dtype=torch.int32)
    for ignored in ({"actual_seq_lengths_kv": new}, {"lens": new}):
        graph.update(cpu_update_input=[ignored])
        graph.replay()
        assert torch.equal(out, captured), ignored
    graph.update(cpu_update_input=[{"context_lens": new}])
    graph.replay()
    expected = torch.zeros_like(out)
    pa(query, key_cache, value_cache, 1, 1, 0.5, table, new, expected)
    assert torch.equal(out, expected) and not torch.equal(out, captured)


def test_fake_update_dict_count_broadcast_and_auto_dispatch_capture():
    """One dict serves every record, another count is torch_npu's RuntimeError; without
    auto_dispatch_capture nothing is recorded and update() raises as torch_npu does."""
    ifa = ifa_standin()
    q, k, v = ifa_inputs()
    a, b = torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)

    def twice():
        a.copy_(ifa(q, k, v, actual_seq_lengths_kv=[6, 6])[0])
        b.copy_(ifa(q, k, v, actual_seq_lengths_kv=[6, 6])[0])

    fake = make_fake_npu()
    graph = _capture(fake, twice)
    assert len(graph.graph_dispatch_mode.graph_dispatch_records) == 2
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [1, 2]}])
    graph.replay()
    want = ifa(q, k, v, actual_seq_lengths_kv=[1, 2])[0]
    assert torch.equal(a, want) and torch.equal(b, want)
    for bad in ([], [{}] * 3):
        with pytest.raises(RuntimeError, match=f"there are 2 operators.*only {len(bad)} elements"):
            graph.update(cpu_update_input=bad)
    plain = _capture(fake, twice, auto=False)
    assert plain.graph_dispatch_mode.graph_dispatch_records == []
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        plain.update(cpu_update_input=[{"actual_seq_lengths_kv": [2, 2]}])
    assert plain.update_calls == 0 and graph.update_calls == 1


# -- 3. torch_npu before the update API ---------------------------------------------------

def test_fake_without_update_api_is_the_old_torch_npu():
    """update_api=False: torch.npu.graph takes no auto_dispatch_capture (a TypeError, as
    on an old torch_npu) and NPUGraph has no update(); plain capture and replay work."""
    fake = make_fake_npu(update_api=False)
    x = torch.ones(2)
    graph = fake.NPUGraph()
    with pytest.raises(TypeError, match="auto_dispatch_capture"):
        fake.graph(graph, pool=fake.graph_pool_handle(), auto_dispatch_capture=True)
    assert not hasattr(fake.NPUGraph, "update")
    y = torch.zeros(2)
    with fake.graph(graph, pool=fake.graph_pool_handle()):
        y.copy_(x * 2)
    x.fill_(3.0)
    graph.replay()
    assert y.tolist() == [6.0, 6.0]
