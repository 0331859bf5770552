"""T5ForConditionalGeneration as pipeline stages (see ``oslo_models/pipeline/adapter.py`` for the vocabulary).

Layers: ``encoder.block`` then ``decoder.block`` (flat layer ``i < E`` is encoder block ``i``, ``E + j`` decoder
block ``j``; ``E = num_layers``). Stages cut that concatenation anywhere: a stage may end the encoder and start the
decoder.

Stage modules: the first stage embeds both ``input_ids`` and ``decoder_input_ids`` with ``shared`` (+ each stack's
input dropout and SP scatter); the stage with encoder block ``E-1`` runs ``encoder.final_layer_norm`` + dropout;
the last one ``decoder.final_layer_norm`` + dropout, the ``d_model**-0.5`` rescale of tied heads and ``lm_head``
(vocab-parallel logits). The stacks' ``embed_tokens`` are ``shared`` under other names: no stage runs them, so
they are dropped. Tied group: ``shared`` (first stage) with ``lm_head`` (last stage) while the checkpoint's head
equals ``shared`` (original T5), as GPT-2; T5 v1.1's own head is no copy.

Why the decoder is embedded on the first stage rather than where decoder block 0 runs: one copy of the vocabulary
embedding fewer (weights, gradients, optimizer state, and a rank fewer in the tied all-reduce) for one activation
``[mb, s_dec(/tp), h]`` more through the encoder stages; and no non-first stage computes from weights alone,
which torch's split (zero-bubble) backward would not see (see ``whole_backward_stages`` for the one exception).

Between stages flow (``h = d_model``, ``n' = num_heads / tp``; ``s/tp`` where that stack runs sequence-parallel,
each TP rank sending its own slice and its own heads to the same TP rank of the next stage):

- into an encoder block: ``(hidden [mb, s_enc(/tp), h], position_bias [1, n', s_enc, s_enc], decoder_hidden
  [mb, s_dec(/tp), h])``, the decoder's embedded inputs riding along;
- into decoder block 0: ``(decoder_hidden, encoder_output [mb, s_enc, h])``, the encoder output after the final
  norm, dropout and SP gather (full and replicated, as the unpipelined model's cross-attention reads it);
- into a later decoder block: ``(hidden [mb, s_dec(/tp), h], position_bias [1, n', s_dec, s_dec],
  encoder_output)``.

Each stack's relative position bias is computed by its block 0 and travels as an activation, so later stages
reuse it and its gradient flows back to block 0's ``relative_attention_bias``; the cross-attention bias (zeros,
no parameters) is recomputed by each stage. ``attention_mask``, ``decoder_input_ids`` (shifted labels unless given)
and ``decoder_attention_mask`` are keywords to every stage; each stage rebuilds its masks from them.

A stage computes with the stacks' own phases (``T5Stack.stack_inputs`` and ``run_stack`` with ``first``/``last``
and the stage's blocks; the sequence-parallel region on for each stack's part), so it computes exactly what the
same blocks compute inside ``forward``. Parameter counts per layer come from the stacks built on the meta device
with no parallelism, not from formulas.
"""
from __future__ import annotations

import torch

from ...distributed.context import ParallelContext
from ...pipeline.adapter import PipelineAdapter
from ..common import token_loss, use_sequence_parallel

ENCODER, DECODER = "encoder.block", "decoder.block"
EMBEDDINGS = ("encoder.embed_tokens", "decoder.embed_tokens")  # aliases of ``shared``: never run, always dropped


class T5PipelineAdapter(PipelineAdapter):
    layer_paths = (ENCODER, DECODER)
    batch_keys = ("input_ids", "labels", "attention_mask", "decoder_input_ids", "decoder_attention_mask")

    def layer_counts(self, model) -> tuple[int, ...]:
        return model.config.num_layers, model.config.num_decoder_layers

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Blocks (decoder blocks with cross-attention, blocks 0 with the position bias; the last encoder layer
        also counts the encoder's final norm); ``shared`` on the first stage; the head (a full ``V x d`` even when
        tied: the last stage holds a copy) and the decoder's final norm on the last. Counted on the model's own
        stacks built on the meta device without parallelism."""
        from .modeling_t5 import T5Stack, _stack_config

        stack_class = getattr(model, "stack_class", T5Stack)  # ``model`` may be transformers' own (tests)
        with torch.device("meta"):
            context = ParallelContext.single_process()
            encoder, decoder = (stack_class(_stack_config(model.config, is_decoder=is_decoder),
                                            parallel_context=context) for is_decoder in (False, True))

        def count(module) -> float:
            return float(sum(p.numel() for p in module.parameters()))

        encoder_costs = [count(block) for block in encoder.block]
        encoder_costs[-1] += count(encoder.final_layer_norm)
        embedding = count(encoder.embed_tokens)
        return (encoder_costs + [count(block) for block in decoder.block], embedding,
                embedding + count(decoder.final_layer_norm))

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        layers, num_encoder = layout.ranges[stage], model.config.num_layers
        modules = {}
        if stage == 0:
            modules.update(shared="shared", encoder_dropout="encoder.dropout", decoder_dropout="decoder.dropout")
        if num_encoder - 1 in layers:
            modules.update(encoder_final_layer_norm="encoder.final_layer_norm", encoder_dropout="encoder.dropout")
        if stage == layout.num_stages - 1:
            modules.update(decoder_final_layer_norm="decoder.final_layer_norm", decoder_dropout="decoder.dropout",
                           lm_head="lm_head")
        return modules

    def optional_modules(self, model, layout) -> set[str]:
        return super().optional_modules(model, layout) | set(EMBEDDINGS)

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        group = ("shared.weight",) + tuple(f"{path}.weight" for path in EMBEDDINGS)
        if getattr(model, "_lm_head_tied", True):
            group += ("lm_head.weight",)
        return [group]

    def whole_backward_stages(self, model, layout) -> set[int]:
        """The stage with decoder block 0, unless it is the last: the position bias it sends on is computed from
        block 0's weights alone, which torch's split (zero-bubble) backward would miss."""
        stage = next(s for s, layers in enumerate(layout.ranges) if model.config.num_layers in layers)
        return {stage} if stage < layout.num_stages - 1 else set()

    # ------------------------------------------------------------------ batches and shapes
    def prepare_batch(self, model, batch):
        if "decoder_input_ids" not in batch:
            batch["decoder_input_ids"] = model._shift_right(batch["labels"])
        return batch

    def use_sequence_parallel(self, model, batch) -> bool:
        """Whether either stack runs sequence-parallel (each decides on its own length, as unpipelined)."""
        encoder = use_sequence_parallel(model, batch["input_ids"].shape[-1])
        decoder = use_sequence_parallel(model, batch["decoder_input_ids"].shape[-1])
        return encoder or decoder

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        config, tp = model.config, model.parallel_context.tp_size
        mb, enc_len = microbatch["input_ids"].shape
        dec_len = microbatch["decoder_input_ids"].shape[-1]
        dtype = next(model.parameters()).dtype
        enc_sp, dec_sp = _stack_sequence_parallel(sequence_parallel, tp, enc_len, dec_len)

        def meta(*shape):
            return torch.empty(*shape, dtype=dtype, device="meta")

        def boundary(layer: int) -> tuple[torch.Tensor, ...]:  # what flows into flat layer ``layer``
            decoder_hidden = meta(mb, dec_len // (tp if dec_sp else 1), config.d_model)
            encoder_output = meta(mb, enc_len, config.d_model)
            if layer < config.num_layers:
                encoder_hidden = meta(mb, enc_len // (tp if enc_sp else 1), config.d_model)
                return encoder_hidden, meta(1, config.num_heads // tp, enc_len, enc_len), decoder_hidden
            if layer == config.num_layers:
                return decoder_hidden, encoder_output
            return decoder_hidden, meta(1, config.num_heads // tp, dec_len, dec_len), encoder_output

        layers = layout.ranges[stage]
        inputs = (microbatch["input_ids"],) if stage == 0 else boundary(layers.start)
        if stage < layout.num_stages - 1:
            return inputs, boundary(layers.stop)
        return inputs, (meta(mb, dec_len, model.lm_head.weight.shape[0]),)

    # ------------------------------------------------------------------ compute
    def stage_forward(self, stage, *inputs, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None):
        config, context = stage.model_config, stage.parallel_context
        encoder, decoder = stage.owner.encoder, stage.owner.decoder
        layers, num_encoder = stage.layout.ranges[stage.stage_index], config.num_layers
        blocks = {ENCODER: [], DECODER: []}
        for (path, _), block in zip(stage.layer_ids, stage.layers):
            blocks[path].append(block)
        if stage.is_first:
            enc_len = inputs[0].shape[-1]
        elif layers.start < num_encoder:
            enc_len = inputs[1].shape[-1]  # the position bias [1, n', s_enc, s_enc]: full length also under SP
        else:
            enc_len = inputs[-1].shape[1]  # the encoder output: full length
        dec_len = decoder_input_ids.shape[-1]
        enc_sp, dec_sp = _stack_sequence_parallel(stage.sequence_parallel, context.tp_size, enc_len, dec_len)
        mb, device = decoder_input_ids.shape[0], decoder_input_ids.device

        def decoder_inputs(encoder_output, dtype):
            return decoder.stack_inputs(_shape_only(mb, dec_len, config.d_model, dtype, device),
                                        decoder_attention_mask, encoder_output, attention_mask,
                                        sequence_parallel=dec_sp)

        # ---- encoder blocks (and, on the first stage, both stacks' embeddings, the encoder's first)
        encoder_ends = num_encoder - 1 in layers
        if stage.is_first:
            inputs_embeds = stage.shared(inputs[0])  # the stacks' embed_tokens are ``shared``: dropped on stages
            enc_inputs = encoder.stack_inputs(_shape_only(mb, enc_len, config.d_model, inputs_embeds.dtype, device),
                                              attention_mask, sequence_parallel=enc_sp)
            hidden, position_bias = encoder.run_stack(None, enc_inputs, blocks=(), last=False,
                                                      inputs_embeds=inputs_embeds)
            # the decoder's embedded inputs [mb, s_dec(/tp), h] ride along through the encoder stages
            decoder_hidden, _ = decoder.run_stack(None, decoder_inputs(None, inputs_embeds.dtype), blocks=(),
                                                  last=False, inputs_embeds=stage.shared(decoder_input_ids))
        elif layers.start < num_encoder:
            hidden, position_bias, decoder_hidden = inputs
            enc_inputs = encoder.stack_inputs(_shape_only(mb, enc_len, config.d_model, hidden.dtype, device),
                                              attention_mask, sequence_parallel=enc_sp)
        if layers.start < num_encoder:
            hidden, position_bias = encoder.run_stack(hidden, enc_inputs, blocks=blocks[ENCODER], first=False,
                                                      last=encoder_ends, position_bias=position_bias)
            if not encoder_ends:
                return _activations(hidden, position_bias, decoder_hidden)
            encoder_output = hidden  # after the final norm, dropout and SP gather
            if not blocks[DECODER]:
                return _activations(decoder_hidden, encoder_output)

        # ---- decoder blocks
        if layers.start > num_encoder:
            hidden, position_bias, encoder_output = inputs
        else:  # this stage runs decoder block 0, which computes the position bias
            if layers.start == num_encoder:
                decoder_hidden, encoder_output = inputs
            hidden, position_bias = decoder_hidden, None
        hidden, position_bias = decoder.run_stack(hidden, decoder_inputs(encoder_output, hidden.dtype),
                                                  blocks=blocks[DECODER],
                                                  first=False, last=stage.is_last, position_bias=position_bias,
                                                  encoder_hidden_states=encoder_output)
        if not stage.is_last:
            return _activations(hidden, position_bias, encoder_output)
        if config.scale_decoder_outputs:  # original T5 (tied head) rescales before the projection
            hidden = hidden * (config.d_model ** -0.5)
        return stage.lm_head(hidden)  # [mb, s_dec, V_padded/tp]

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.lm_head, num_items_in_batch=num_items_in_batch)


def _stack_sequence_parallel(sequence_parallel: bool, tp: int, enc_len: int, dec_len: int) -> tuple[bool, bool]:
    """Each stack runs sequence-parallel when it is on and the stack's length splits evenly (as unpipelined)."""
    return sequence_parallel and enc_len % tp == 0, sequence_parallel and dec_len % tp == 0


def _activations(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Outputs to send: point-to-point sends need contiguous tensors (the position bias is a permuted view)."""
    return tuple(tensor.contiguous() for tensor in tensors)


def _shape_only(batch: int, seq_len: int, hidden: int, dtype, device) -> torch.Tensor:
    """The masks read only the batch size, length, dtype and device of ``inputs_embeds``: a zero-size expanded
    view stands in for the full ``[mb, s, h]`` activations (a stage holds ``[mb, s/tp, h]`` under SP)."""
    return torch.zeros((), dtype=dtype, device=device).expand(batch, seq_len, hidden)
