"""Pipeline stages of every encoder-decoder (T5 / mT5, BART): one adapter over the two stacks' own phases; a family
names its stacks and embeddings in a few hooks (``t5/pipeline_t5.py``, ``bart/pipeline_bart.py``).

Layers: the encoder's then the decoder's (flat layer ``i < E`` is encoder layer ``i``, ``E + j`` decoder layer
``j``); stages cut that concatenation anywhere: a stage may end the encoder and start the decoder. The first stage
embeds both ``input_ids`` and ``decoder_input_ids`` with ``shared`` (the stacks' ``embed_tokens`` are aliases of it
that no stage runs: dropped; the decoder's embedded inputs ride along through the encoder stages, so no later stage
holds a vocabulary copy); the stage with the last encoder layer finishes the encoder (final norm, SP gather); the
last stage finishes the decoder and runs the head. Tied group: ``shared`` with its aliases (and ``lm_head`` when
the head is tied to it).

Between stages flow (``d = d_model``; ``s/tp`` where that stack runs sequence-parallel, each TP rank sending its own
slice to the same TP rank of the next stage; ``bias``: a family's tensors carried from a stack's layer 0 to its
later layers, T5's relative position bias ``[1, n/tp, s, s]``, none for BART):

- into an encoder layer: ``(hidden [mb, s_enc(/tp), d], *bias, decoder_hidden [mb, s_dec(/tp), d])``;
- into decoder layer 0: ``(decoder_hidden, encoder_output [mb, s_enc, d])``, the encoder output full and
  replicated (as the unpipelined cross-attention reads it);
- into a later decoder layer: ``(hidden [mb, s_dec(/tp), d], *bias, encoder_output)``.

``attention_mask`` (all ones when the batch has none), ``decoder_input_ids`` (shifted labels unless given) and
``decoder_attention_mask`` are keywords to every stage; each stage rebuilds its masks from them with the stacks' own
phases (``stack_inputs``, ``run_stack`` with ``first``/``last`` and the stage's layers), so a stage computes exactly
what the same layers compute inside ``forward``. The last stage's output and loss are the head's: the vocab-split
logits ``[mb, s_dec, V_padded/tp]`` and ``token_loss`` for the LM head (``SEQ2SEQ_LM``), another head's task rule
otherwise (``common/loss/head_rules.py``).
"""
from __future__ import annotations

import torch

from ....pipeline.adapter import PipelineAdapter
from ..loss.head_rules import SEQ2SEQ_LM, RuleLoss
from ..stack.sequence_parallel import use_sequence_parallel


class EncoderDecoderPipelineAdapter(RuleLoss, PipelineAdapter):
    """Family hooks: ``prefix`` (the stacks' parent, ``"model."`` for BART), ``layer_counts``,
    ``layer_parameter_counts``, ``stage_modules``, ``head_tied``, ``shift``, ``bias_shape``, ``embed``,
    ``decoder_inputs`` and ``run``. ``rule``: the head's task rule."""

    prefix = ""
    batch_keys = ("input_ids", "labels", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
    rule = SEQ2SEQ_LM

    def optional_modules(self, model, layout) -> set[str]:
        return super().optional_modules(model, layout) | set(self._aliases())

    def _aliases(self) -> tuple[str, ...]:
        return f"{self.prefix}encoder.embed_tokens", f"{self.prefix}decoder.embed_tokens"

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        group = (f"{self.prefix}shared.weight",) + tuple(f"{path}.weight" for path in self._aliases())
        return [group + (("lm_head.weight",) if self.head_tied(model) else ())]

    # ------------------------------------------------------------------ the family's hooks
    def head_tied(self, model) -> bool:
        """Whether ``lm_head`` is ``shared`` (one tensor in ``transformers``) for this model."""
        raise NotImplementedError

    def shift(self, model, ids: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs from ``ids [b, s]``: shifted right, the decoder start token first."""
        raise NotImplementedError

    def bias_shape(self, model, seq_len: int) -> tuple[int, ...] | None:
        """The shape of what a stack's layer 0 hands its later layers besides the hidden states, or ``None``."""
        return None

    def stacks(self, model) -> tuple:
        """``(encoder, decoder)`` of ``model`` (the stacks' phases; their layers may be absent on this rank)."""
        raise NotImplementedError

    def embed(self, stage, stack, ids: torch.Tensor) -> torch.Tensor:
        """``[mb, s] -> [mb, s, d]``: the first stage's token embeddings for ``stack`` (``stage.shared``)."""
        return stage.shared(ids)

    def decoder_inputs(self, decoder, like, decoder_attention_mask, encoder_output, attention_mask,
                       sequence_parallel: bool) -> tuple:
        """``(the decoder's stack_inputs, keywords of its run)``; ``encoder_output`` is ``None`` on the first stage
        (embedding only)."""
        raise NotImplementedError

    def run(self, stack, hidden, inputs, blocks, last: bool, bias, **kwargs) -> tuple:
        """``stack.run_stack`` on ``blocks`` (``first`` when ``hidden`` is ``None``) -> ``(hidden, bias)``."""
        raise NotImplementedError

    def head_forward(self, stage, hidden: torch.Tensor, **head_inputs) -> torch.Tensor:
        """The last stage's output from the decoder output ``[mb, s_dec, d]``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ batches and shapes
    def prepare_batch(self, model, batch):
        if "decoder_input_ids" not in batch:  # the family's shift of the labels (the heads': of input_ids)
            batch["decoder_input_ids"] = self.shift(model, batch["labels" if self.rule is SEQ2SEQ_LM else "input_ids"])
        if "attention_mask" not in batch:  # every stage reads the encoder length from it
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return self.rule.prepare_batch(model, batch, span_key="decoder_input_ids")

    def use_sequence_parallel(self, model, batch) -> bool:
        """Whether either stack runs sequence-parallel (each decides on its own length, as unpipelined)."""
        return (use_sequence_parallel(model, batch["input_ids"].shape[-1])
                or use_sequence_parallel(model, batch["decoder_input_ids"].shape[-1]))

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        config, tp = model.config, model.parallel_context.tp_size
        mb, enc_len = microbatch["input_ids"].shape
        dec_len = microbatch["decoder_input_ids"].shape[-1]
        dtype, num_encoder = next(model.parameters()).dtype, self.layer_counts(model)[0]
        enc_sp, dec_sp = _stack_sequence_parallel(sequence_parallel, tp, enc_len, dec_len)

        def meta(*shape):
            return torch.empty(*shape, dtype=dtype, device="meta")

        def bias(seq_len):
            shape = self.bias_shape(model, seq_len)
            return () if shape is None else (meta(*shape),)

        def boundary(layer: int) -> tuple[torch.Tensor, ...]:  # what flows into flat layer ``layer``
            decoder_hidden = meta(mb, dec_len // (tp if dec_sp else 1), config.d_model)
            encoder_output = meta(mb, enc_len, config.d_model)
            if layer < num_encoder:
                return meta(mb, enc_len // (tp if enc_sp else 1), config.d_model), *bias(enc_len), decoder_hidden
            if layer == num_encoder:
                return decoder_hidden, encoder_output
            return decoder_hidden, *bias(dec_len), encoder_output

        layers = layout.ranges[stage]
        inputs = (microbatch["input_ids"],) if stage == 0 else boundary(layers.start)
        if stage < layout.num_stages - 1:
            return inputs, boundary(layers.stop)
        return inputs, (meta(*self.rule.output_shape(model, mb, dec_len)),)

    # ------------------------------------------------------------------ compute
    def stage_forward(self, stage, *inputs, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                      **head_inputs):
        config, context = stage.model_config, stage.parallel_context
        encoder, decoder = self.stacks(stage.owner)
        layers, num_encoder = stage.layout.ranges[stage.stage_index], self.layer_counts(stage.owner)[0]
        blocks = ([], [])
        for (path, _), layer in zip(stage.layer_ids, stage.layers):
            blocks[path != self.layer_paths[0]].append(layer)
        (mb, enc_len), dec_len = attention_mask.shape, decoder_input_ids.shape[-1]
        enc_sp, dec_sp = _stack_sequence_parallel(stage.sequence_parallel, context.tp_size, enc_len, dec_len)
        device, dtype = decoder_input_ids.device, next(stage.owner.parameters()).dtype
        dec_like = _shape_only(mb, dec_len, config.d_model, dtype, device)
        carries = self.bias_shape(stage.owner, 1) is not None

        # ---- encoder layers (and, on the first stage, both stacks' embeddings, the encoder's first)
        if layers.start < num_encoder:
            enc_inputs = encoder.stack_inputs(_shape_only(mb, enc_len, config.d_model, dtype, device),
                                              attention_mask, sequence_parallel=enc_sp)
            bias = None
            if stage.is_first:  # the stacks' embed_tokens are ``shared``: dropped on stages
                hidden, _ = self.run(encoder, None, enc_inputs, (), False, None,
                                     inputs_embeds=self.embed(stage, encoder, inputs[0]))
                dec_inputs, _ = self.decoder_inputs(decoder, dec_like, decoder_attention_mask, None, attention_mask,
                                                    dec_sp)
                decoder_hidden, _ = self.run(decoder, None, dec_inputs, (), False, None,
                                             inputs_embeds=self.embed(stage, decoder, decoder_input_ids))
            else:
                hidden, *rest = inputs
                bias, decoder_hidden = (rest[0], rest[1]) if carries else (None, rest[0])
            encoder_ends = num_encoder - 1 in layers
            hidden, bias = self.run(encoder, hidden, enc_inputs, blocks[0], encoder_ends, bias)
            if not encoder_ends:
                return _activations(hidden, *((bias,) if carries else ()), decoder_hidden)
            hidden, encoder_output, bias = decoder_hidden, hidden, None  # the encoder output, full length
            if not blocks[1]:
                return _activations(hidden, encoder_output)
        elif layers.start == num_encoder:
            (hidden, encoder_output), bias = inputs, None
        else:
            hidden, *rest = inputs
            bias, encoder_output = (rest[0], rest[1]) if carries else (None, rest[0])

        # ---- decoder layers
        dec_inputs, cross = self.decoder_inputs(decoder, dec_like, decoder_attention_mask, encoder_output,
                                                attention_mask, dec_sp)
        hidden, bias = self.run(decoder, hidden, dec_inputs, blocks[1], stage.is_last, bias,
                                encoder_hidden_states=encoder_output, **cross)
        if not stage.is_last:
            return _activations(hidden, *((bias,) if carries else ()), encoder_output)
        return self.head_forward(stage, hidden, **head_inputs)


def _stack_sequence_parallel(sequence_parallel: bool, tp: int, enc_len: int, dec_len: int) -> tuple[bool, bool]:
    """Each stack runs sequence-parallel when it is on and the stack's length splits evenly (as unpipelined)."""
    return sequence_parallel and enc_len % tp == 0, sequence_parallel and dec_len % tp == 0


def _activations(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Outputs to send: point-to-point sends need contiguous tensors (T5's position bias is a permuted view)."""
    return tuple(tensor.contiguous() for tensor in tensors)


def _shape_only(batch: int, seq_len: int, hidden: int, dtype, device) -> torch.Tensor:
    """A zero-size expanded ``[mb, s, d]`` view: the masks read only its batch, length, dtype and device."""
    return torch.zeros((), dtype=dtype, device=device).expand(batch, seq_len, hidden)
