"""LoRA through ``peft`` on parallel models, against plain ``peft`` on plain ``transformers`` (fp32, atol 1e-5).

An adapter made by plain ``peft`` (random ``A`` and ``B``: ``init_lora_weights=False``) is loaded onto our model
(sliced), trained 3 AdamW steps: losses and every adapter piece equal the reference's; the gathered save opens in
plain ``peft`` with the reference's logits; ``merge_and_unload`` + ``save_pretrained`` opens in plain
``transformers`` with the merged reference's logits. Layouts (4 ranks, one group per family): tp2 + SP x dp2,
tp4, tp2 x dp2 ZeRO-3, pp2 x tp2 (GPT-2, Llama), tp2 x dp2 ZeRO-1/2 (Llama). tp 1 runs in the test process, with
``get_peft_model``'s own init. Llama's group also checks ``lora_dropout`` (peft's masks at tp2 + SP and tp4) and the
refusal of a plain ``LoraConfig`` at tp4. Pipelined (pp2 x tp2, and Llama's pp2 with plain peft's own layers): plain
``PeftModel.save_pretrained`` raises naming ``save_adapter`` and writes no adapter (peft would save one stage);
``save_adapter`` writes every stage.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers

peft = pytest.importorskip("peft")

import oslo_models as om  # noqa: E402
from oslo_models import adapters, training  # noqa: E402
from oslo_models.adapters.lora import ParallelLoraLinear  # noqa: E402
from oslo_models.parallel_layers.tensor_parallel import RowParallelLinear  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.models import padded_batch  # noqa: E402
from tests.helpers.pipeline import ADAMW, local_rows  # noqa: E402
from tests.helpers.zoo import tiny_config  # noqa: E402

CASES = {  # model type: (transformers class, oslo auto class, LoRA targets)
    "gpt2": (transformers.GPT2LMHeadModel, "AutoModelForCausalLM", ["c_attn", "c_proj"]),
    "llama": (transformers.LlamaForCausalLM, "AutoModelForCausalLM", ["q_proj", "v_proj", "down_proj", "gate_proj"]),
    "bert": (transformers.BertForMaskedLM, "AutoModelForMaskedLM", ["query", "value", "dense"]),
}
STEPS = 3


def _save_case(model_type: str, root) -> tuple[str, str]:
    """The tiny base model and a plain-peft adapter on it (random A and B), both saved; returns both paths."""
    hf_class, _, targets = CASES[model_type]
    torch.manual_seed(0)
    base = os.path.join(root, "base")
    hf_class(tiny_config(model_type)).save_pretrained(base)
    torch.manual_seed(1)
    reference = peft.get_peft_model(hf_class.from_pretrained(base),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    adapter = os.path.join(root, "adapter")
    reference.save_pretrained(adapter)
    return base, adapter


def _reference(model_type: str, base: str, adapter: str):
    hf_class = CASES[model_type][0]
    return peft.PeftModel.from_pretrained(hf_class.from_pretrained(base), adapter, is_trainable=True).train()


def _ours(model_type: str, base: str, adapter: str | None, **layout):
    auto = getattr(om, CASES[model_type][1])
    model = auto.from_pretrained(base, parallel=om.ParallelConfig(**layout), progress=False).train()
    return model if adapter is None else adapters.load_adapter(model, adapter, is_trainable=True)


def _batch(model_type: str, rows: int = 4, seq: int = 8) -> dict:
    ids, mask, labels = padded_batch(tiny_config(model_type).vocab_size, batch=rows, seq=seq)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def assert_adapters_match(model, reference, atol: float = 1e-5, grads: bool = False) -> int:
    """Every adapter piece of ``model`` (its gradient with ``grads``) equals its slice of the reference's full
    tensor; returns how many."""
    full = {name: param.grad if grads else param for name, param in reference.named_parameters()}
    checked = 0
    for owner_name, owner in model.named_modules():
        if not isinstance(owner, ParallelLoraLinear):
            continue
        for key, layout in owner.adapter_param_layouts().items():
            local = owner.get_parameter(key).grad if grads else owner.get_parameter(key).detach()
            local = local.full_tensor() if hasattr(local, "full_tensor") else local
            expected = owner._slice(layout, full[f"{owner_name}.{key}"].detach())
            torch.testing.assert_close(local, expected, atol=atol, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
            checked += 1
    assert checked, "no adapter found"
    return checked


def _trainable(model):
    return [param for param in model.parameters() if param.requires_grad]


def _train(model, reference, batch: dict, *, zero_stage: int = 0) -> None:
    """3 AdamW steps on the adapters; data-parallel replica ``d`` takes rows ``d::dp``; loss and adapters compared."""
    context = model.parallel_context
    ref_opt = torch.optim.AdamW(_trainable(reference), **ADAMW)
    opt = torch.optim.AdamW(_trainable(model), **ADAMW)
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    if context.pp_size > 1:
        local = local_rows(context, batch)
        for _ in range(STEPS):
            expected = reference(**batch).loss
            expected.backward()
            torch.testing.assert_close(model.train_step(local), expected.detach(), atol=1e-5, rtol=1e-5)
            ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        assert_adapters_match(model, reference)
        return
    replicas = [{k: v[d::context.dp_size].contiguous() for k, v in batch.items()} for d in range(context.dp_size)]
    wrapped = model
    if zero_stage:
        from accelerate import Accelerator

        wrapped, opt = training.prepare(Accelerator(cpu=True), model, opt, zero_stage=zero_stage)
        adapter_ids = {id(p) for name, p in model.named_parameters() if "lora_" in name}
        held = [p for group in training.unwrap_optimizer(opt).param_groups for p in group["params"]]
        assert held and all(id(p) in adapter_ids for p in held), "only adapter parameters in the optimizer"
    elif context.dp_size > 1:
        wrapped, opt = training.shard_data_parallel(model, opt)
    for _ in range(STEPS):
        outputs = [reference(**replica) for replica in replicas]
        got = wrapped(**replicas[context.dp_rank])
        torch.testing.assert_close(got.loss, outputs[context.dp_rank].loss, atol=1e-5, rtol=1e-5)
        (sum(out.loss for out in outputs) / len(outputs)).backward()
        got.loss.backward()
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    assert_adapters_match(model, reference)


def _check_saved(model_type: str, model, reference, base: str, folder: str, *, merge: bool) -> None:
    """The gathered adapter opens in plain peft with the trained reference's logits; merged weights (``merge``)
    saved by our model open in plain transformers with the merged reference's logits."""
    context = model.parallel_context
    ids = _batch(model_type)["input_ids"]
    if context.pp_size > 1:  # peft would keep the entries of the LoRA layers a rank holds (its stage's): refused
        _check_stage_export_refused(model, folder)
        adapters.save_adapter(model, os.path.join(folder, "adapter"))
    else:  # the standard call on every rank: its state dict holds the adapters gathered (ParallelLoraLinear's hook)
        model.save_pretrained(os.path.join(folder, "adapter"), is_main_process=context.rank == 0)
        context.barrier()
    with torch.no_grad():
        expected = reference.eval()(input_ids=ids).logits
    if context.rank == 0:
        reopened = peft.PeftModel.from_pretrained(CASES[model_type][0].from_pretrained(base),
                                                  os.path.join(folder, "adapter")).eval()
        with torch.no_grad():
            torch.testing.assert_close(reopened(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    if not merge:
        return
    merged = model.merge_and_unload()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    merged.save_pretrained(os.path.join(folder, "merged"))
    if context.rank == 0:
        plain = CASES[model_type][0].from_pretrained(os.path.join(folder, "merged")).eval()
        with torch.no_grad():
            merged_reference = reference.merge_and_unload()(input_ids=ids).logits
            torch.testing.assert_close(plain(input_ids=ids).logits, merged_reference, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(merged_reference, expected, atol=1e-5, rtol=1e-5)
    context.barrier()


def _check_stage_export_refused(model, folder: str) -> None:
    """Pipelined: plain ``PeftModel.save_pretrained`` on every rank raises, naming ``save_adapter``, before writing
    an adapter (peft would write this stage's adapters alone: the negative control of the guard)."""
    context = model.parallel_context
    plain = os.path.join(folder, "plain_save")
    with pytest.raises(NotImplementedError, match="adapters.save_adapter"):
        model.save_pretrained(plain, is_main_process=context.rank == 0)
    context.barrier()
    assert not any(os.path.exists(os.path.join(plain, name)) for name in ("adapter_model.safetensors",
                                                                          "adapter_config.json"))


def _check_lone_save_refused(model, root: str) -> None:
    """``if rank == 0: model.save_pretrained(...)`` at tp > 1: rank 0 gets the rule within the arrival timeout
    instead of hanging in the adapters' gather (the other ranks never take a state dict)."""
    context = model.parallel_context
    if context.rank == 0:
        os.environ["OSLO_ARRIVAL_TIMEOUT"] = "2"
        try:
            with pytest.raises(RuntimeError, match="every rank takes the state dict"):
                model.save_pretrained(os.path.join(root, "lone"))
        finally:
            del os.environ["OSLO_ARRIVAL_TIMEOUT"]
    context.barrier()


def _check_pipeline_plain_peft(model_type: str, base: str, adapter: str, root: str) -> None:
    """pp 2 alone (x dp 2), adapter loaded by plain peft (peft's own LoRA layers at tp 1): the guard sits on the
    model, not on our layers; save_adapter writes every stage (the reopened adapter gives the reference's logits)."""
    model = peft.PeftModel.from_pretrained(_ours(model_type, base, None, pipeline_parallel_size=2,
                                                 num_microbatches=2), adapter)
    folder = os.path.join(root, "pp2_plain")
    _check_stage_export_refused(model, folder)
    adapters.save_adapter(model, os.path.join(folder, "adapter"))
    if model.parallel_context.rank == 0:
        ids = _batch(model_type)["input_ids"]
        reopened = peft.PeftModel.from_pretrained(CASES[model_type][0].from_pretrained(base),
                                                  os.path.join(folder, "adapter")).eval()
        with torch.no_grad():
            torch.testing.assert_close(reopened(input_ids=ids).logits,
                                       _reference(model_type, base, adapter).eval()(input_ids=ids).logits,
                                       atol=1e-5, rtol=1e-5)
    model.parallel_context.barrier()


def _dropout_adapter(adapter: str, p: float = 0.25, **options) -> str:
    """A copy of the adapter folder with ``lora_dropout=p`` (and other ``LoraConfig`` ``options``)."""
    import json
    import shutil

    folder = adapter + ("_dropout" if not options else "_" + "_".join(options))
    shutil.copytree(adapter, folder)
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as handle:
        config = json.load(handle)
    with open(path, "w") as handle:
        json.dump({**config, "lora_dropout": p, **options}, handle)
    return folder


def _check_dropout(model_type: str, base: str, adapter: str, **layout) -> None:
    """``lora_dropout > 0``: from the same RNG state, every rank draws plain peft's masks (row-parallel ``A``: its
    slice of the full-width mask), so the loss and every adapter gradient equal plain peft's on this data-parallel
    replica's rows (the model itself is not wrapped: no gradient averaging over dp)."""
    model, reference = _ours(model_type, base, adapter, **layout), _reference(model_type, base, adapter)
    om.distributed.mark_gradients_reduced(model, "test: per-replica gradients compared, not trained")
    context = model.parallel_context
    batch = {k: v[context.dp_rank::context.dp_size].contiguous() for k, v in _batch(model_type).items()}
    with torch.no_grad():
        undropped = reference.eval()(**batch).loss
    reference.train()
    torch.manual_seed(11)
    expected = reference(**batch).loss
    expected.backward()
    assert not torch.allclose(expected, undropped), "the dropout did not draw"
    torch.manual_seed(11)
    got = model(**batch).loss
    got.backward()
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_adapters_match(model, reference, grads=True)


def _layouts_worker(model_type: str, base: str, adapter: str, root: str) -> None:
    if model_type == "llama":  # lora_dropout: column-parallel q/v/gate, row-parallel down_proj, with SP
        for layout in (dict(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2),
                       dict(tensor_parallel_size=4)):
            _check_dropout(model_type, base, adapter + "_dropout", **layout)
        # plain peft at tp > 1 (a plain LoraConfig): peft builds its own layers, the model replaces them when peft
        # sets its peft_config. A loaded adapter is plain peft's and trains like it ...
        model = peft.PeftModel.from_pretrained(_ours(model_type, base, None, tensor_parallel_size=4), adapter,
                                               is_trainable=True)
        assert any(isinstance(module, ParallelLoraLinear) for module in model.modules())
        reference = _reference(model_type, base, adapter)
        assert_adapters_match(model, reference)
        _train(model, reference, _batch(model_type))
        _check_lone_save_refused(model, root)
        # ... and a fresh one is a valid init, the same on every rank (peft drew at the local sizes, so not its
        # single-process values: warned), with B zero: the model starts as the base model
        ours = _ours(model_type, base, None, tensor_parallel_size=4)
        with pytest.warns(UserWarning, match="not bit-identical"):
            fresh = peft.get_peft_model(ours, peft.LoraConfig(r=4, target_modules=CASES[model_type][2]))
        layers = [m for m in fresh.modules() if isinstance(m, ParallelLoraLinear)]
        assert len(layers) == 4 * ours.config.num_hidden_layers  # q, v, gate, down
        for layer in layers:
            a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
            assert a.abs().sum() > 0 and not b.any()
            copies = [torch.empty_like(a) for _ in range(dist.get_world_size())]
            dist.all_gather(copies, a.contiguous())  # one tp group of 4: replicated A equal, split A distinct
            assert all(torch.equal(c, copies[0]) for c in copies) == (not isinstance(layer.get_base_layer(),
                                                                                   RowParallelLinear))
        _check_pipeline_plain_peft(model_type, base, adapter, root)  # after the fresh draws: stages draw unequally
    layouts = [("tp2_sp_dp2", 0, dict(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2)),
               ("tp4", 0, dict(tensor_parallel_size=4)),
               ("tp2_dp2_zero3", 3, dict(tensor_parallel_size=2, data_parallel_size=2))]
    if model_type == "llama":  # ZeRO-1/2: only the adapters in the (sharded) optimizer
        layouts += [("tp2_dp2_zero1", 1, dict(tensor_parallel_size=2, data_parallel_size=2)),
                    ("tp2_dp2_zero2", 2, dict(tensor_parallel_size=2, data_parallel_size=2))]
    if model_type != "bert":
        layouts.append(("pp2_tp2", 0, dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2)))
    for name, zero_stage, layout in layouts:
        model, reference = _ours(model_type, base, adapter, **layout), _reference(model_type, base, adapter)
        assert_adapters_match(model, reference)
        _train(model, reference, _batch(model_type), zero_stage=zero_stage)
        folder = os.path.join(root, name)
        _check_saved(model_type, model, reference, base, folder, merge=zero_stage <= 1)


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_lora_matches_peft_at_every_layout(model_type, tmp_path):
    base, adapter = _save_case(model_type, tmp_path)
    _dropout_adapter(adapter)
    # tp 1: get_peft_model's own init equals plain peft's (same seed), then the loaded-adapter checks
    hf_class, _, targets = CASES[model_type]
    torch.manual_seed(3)
    fresh = peft.get_peft_model(_ours(model_type, base, None), adapters.lora_config(r=4, target_modules=targets))
    torch.manual_seed(3)
    plain = peft.get_peft_model(hf_class.from_pretrained(base), peft.LoraConfig(r=4, target_modules=targets))
    assert_adapters_match(fresh, plain, atol=0)
    model, reference = _ours(model_type, base, adapter), _reference(model_type, base, adapter)
    _train(model, reference, _batch(model_type))
    _check_saved(model_type, model, reference, base, str(tmp_path / "tp1"), merge=True)
    run_distributed(_layouts_worker, 4, model_type, base, adapter, str(tmp_path), timeout=600)


def test_refusals_and_negative_control(tmp_path):
    """DoRA and base-weight inits are refused with the reason; rsLoRA matches plain peft (tp 1); plain peft on a
    conv1d-layout weight gets our layer and merges like the reference; a square conv1d-layout layer merged as if its
    weight were [out, in] (the transpose the layout decides, broken on purpose) misses the merged reference."""
    base, adapter = _save_case("gpt2", tmp_path)
    with pytest.raises(NotImplementedError, match="DoRA"):
        peft.get_peft_model(_ours("gpt2", base, None), adapters.lora_config(r=4, target_modules=["c_attn"],
                                                                            use_dora=True))
    with pytest.raises(NotImplementedError, match="base weight"):
        peft.get_peft_model(_ours("gpt2", base, None), adapters.lora_config(r=4, target_modules=["c_attn"],
                                                                            init_lora_weights="pissa"))
    # plain peft on a conv1d-layout weight: its own layer would merge c_attn untransposed; the model replaces it
    plain = peft.get_peft_model(_ours("gpt2", base, None), peft.LoraConfig(r=4, target_modules=["c_attn"]))
    layers = [m for n, m in plain.named_modules() if n.endswith("attn.c_attn")]
    assert layers and all(isinstance(m, ParallelLoraLinear) for m in layers)
    llama_base, _ = _save_case("llama", tmp_path / "llama")  # tp 1, linear layout: plain peft is right, allowed
    peft.get_peft_model(_ours("llama", llama_base, None), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    ids = _batch("gpt2")["input_ids"]
    rslora = _dropout_adapter(adapter, 0.0, use_rslora=True)  # rsLoRA works: scaling alpha / sqrt(r)
    with torch.no_grad():
        ours, plain = _ours("gpt2", base, rslora).eval(), _reference("gpt2", base, rslora).eval()
        torch.testing.assert_close(ours(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain(input_ids=ids).logits, _reference("gpt2", base, adapter).eval()(
            input_ids=ids).logits, atol=1e-4), "use_rslora changed nothing"
        expected = _reference("gpt2", base, adapter).merge_and_unload().eval()(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(_ours("gpt2", base, None), adapter)  # plain peft's own loader
        torch.testing.assert_close(loaded.merge_and_unload().eval()(input_ids=ids).logits, expected, atol=1e-5,
                                   rtol=1e-5)
        model = _ours("gpt2", base, adapter).eval()
        for name, module in model.named_modules():
            if isinstance(module, ParallelLoraLinear) and name.endswith("attn.c_proj"):  # [32, 32]: merges either way
                module.fan_in_fan_out = False
        broken = model.merge_and_unload()(input_ids=ids).logits
    assert not torch.allclose(broken, expected, atol=1e-3)
