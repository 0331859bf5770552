"""Model testers for ``transformers``' ``ModelTesterMixin``, one per family: a tiny config and its inputs.

``ModelTesterMixin`` reads its model through a "model tester" (``prepare_config_and_inputs_for_common``,
``batch_size``, ``seq_length``, ``num_hidden_layers``, ...). ``transformers`` keeps its own testers in the family test
files, which its PyPI distribution does not ship (see ``fetch.py``); these are ours, with the sizes and input
conventions of ``transformers``' GPT-2 / BERT / RoBERTa / T5 testers (ids avoid special tokens, T5 inputs end in
``<eos>`` so the sequence classifier finds it).
"""
from __future__ import annotations

import torch
import transformers


def ids_tensor(shape, vocab_size: int, low: int = 0, generator=None) -> torch.Tensor:
    return torch.randint(low, vocab_size, shape, generator=generator)


def random_attention_mask(shape, generator=None) -> torch.Tensor:
    mask = torch.randint(0, 2, shape, generator=generator)
    mask[:, -1] = 1  # at least one token attended per row, as transformers' helper
    return mask


class _Tester:
    batch_size, seq_length, vocab_size = 3, 7, 99
    hidden_size, num_hidden_layers, num_attention_heads, intermediate_size = 32, 2, 4, 37
    num_choices = 4  # configs keep num_labels=2 (the default), as transformers' testers: span heads need 2
    is_training, use_labels = True, True

    def __init__(self, parent):
        self.parent = parent

    def extra_labels(self, model_class) -> dict:
        """Labels ``ModelTesterMixin._prepare_for_class`` does not know for ``model_class`` (family-specific)."""
        return {}

    def prepare_config_and_inputs_for_common(self):
        generator = torch.Generator().manual_seed(0)
        config = self.get_config()
        return config, self.inputs(config, generator)


class GPT2Tester(_Tester):
    def get_config(self):
        return transformers.GPT2Config(
            vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.num_hidden_layers,
            n_head=self.num_attention_heads, n_inner=self.intermediate_size, n_positions=512,
            activation_function="gelu", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, initializer_range=0.02,
            bos_token_id=self.vocab_size - 1, eos_token_id=self.vocab_size - 1,
            pad_token_id=self.vocab_size - 1, use_cache=True)

    def inputs(self, config, generator):
        shape = (self.batch_size, self.seq_length)
        return {"input_ids": ids_tensor(shape, self.vocab_size - 1, generator=generator),
                "token_type_ids": ids_tensor(shape, 16, generator=generator),  # transformers' type_vocab_size
                "attention_mask": random_attention_mask(shape, generator)}


class BertTester(_Tester):
    config_class = transformers.BertConfig
    type_vocab_size = 16

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
            max_position_embeddings=512, type_vocab_size=self.type_vocab_size, initializer_range=0.02,
            is_decoder=False, pad_token_id=1)

    def inputs(self, config, generator):
        shape = (self.batch_size, self.seq_length)
        return {"input_ids": ids_tensor(shape, self.vocab_size, low=2, generator=generator),
                "token_type_ids": ids_tensor(shape, self.type_vocab_size, generator=generator),
                "attention_mask": random_attention_mask(shape, generator)}


    def extra_labels(self, model_class) -> dict:
        if model_class.__name__ != "BertForPreTraining":
            return {}
        return {"labels": torch.zeros((self.batch_size, self.seq_length), dtype=torch.long),
                "next_sentence_label": torch.zeros(self.batch_size, dtype=torch.long)}


class RobertaTester(BertTester):
    config_class = transformers.RobertaConfig


class T5Tester(_Tester):
    encoder_seq_length, decoder_seq_length = 7, 7
    intermediate_size, eos_token_id, pad_token_id, decoder_start_token_id = 37, 1, 0, 0

    def get_config(self):
        return transformers.T5Config(
            vocab_size=self.vocab_size, d_model=self.hidden_size, d_ff=self.intermediate_size,
            d_kv=self.hidden_size // self.num_attention_heads, num_layers=self.num_hidden_layers,
            num_decoder_layers=self.num_hidden_layers, num_heads=self.num_attention_heads,
            relative_attention_num_buckets=8, dropout_rate=0.1, initializer_factor=0.002,
            eos_token_id=self.eos_token_id, bos_token_id=self.pad_token_id, pad_token_id=self.pad_token_id,
            decoder_start_token_id=self.decoder_start_token_id)

    def inputs(self, config, generator):
        input_ids = ids_tensor((self.batch_size, self.encoder_seq_length), self.vocab_size, low=2,
                               generator=generator)
        input_ids[:, -1] = self.eos_token_id  # the sequence classifier reads the last <eos>
        decoder_input_ids = ids_tensor((self.batch_size, self.decoder_seq_length), self.vocab_size, low=2,
                                       generator=generator)
        return {"input_ids": input_ids, "attention_mask": random_attention_mask(input_ids.shape, generator),
                "decoder_input_ids": decoder_input_ids,
                "decoder_attention_mask": random_attention_mask(decoder_input_ids.shape, generator)}


class T5EncoderTester(T5Tester):
    """``T5EncoderModel`` / ``T5ForTokenClassification``: encoder inputs only, ``is_encoder_decoder=False`` and no
    training tests (``T5EncoderModel`` has no loss), as transformers' encoder-only T5 tester."""

    is_training = False

    def get_config(self):
        config = super().get_config()
        config.is_encoder_decoder = False
        return config

    def inputs(self, config, generator):
        inputs = super().inputs(config, generator)
        return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}


class LlamaTester(_Tester):
    """transformers' Llama tester sizes (``CausalLMModelTester``): 4 heads over 2 key/value heads (grouped-query),
    pad token 0 and ids from 1 (the sequence classifier pools the last non-pad token)."""

    config_class = transformers.LlamaConfig
    num_key_value_heads, pad_token_id = 2, 0

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, hidden_act="silu", max_position_embeddings=512,
            initializer_range=0.02, pad_token_id=self.pad_token_id, bos_token_id=1, eos_token_id=2)

    def inputs(self, config, generator):
        shape = (self.batch_size, self.seq_length)
        return {"input_ids": ids_tensor(shape, self.vocab_size, low=1, generator=generator),
                "attention_mask": torch.tril(torch.ones(shape, dtype=torch.long))}


class Qwen2Tester(LlamaTester):
    """Qwen2: q/k/v biases and tied embeddings (transformers' Qwen2 default)."""

    config_class = transformers.Qwen2Config


class GPTNeoXTester(LlamaTester):
    """GPT-NeoX: per-head packed q|k|v, partial rotary (half of each head), parallel residual, biased attention."""

    def get_config(self):
        return transformers.GPTNeoXConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act="gelu", rotary_pct=0.5, hidden_dropout=0.1, attention_dropout=0.1,
            max_position_embeddings=512, initializer_range=0.02, pad_token_id=self.pad_token_id, bos_token_id=1,
            eos_token_id=2)


class GPTJTester(LlamaTester):
    """GPT-J: interleaved partial rotary (``rotary_dim`` 4 of 8), one shared norm, biased LM head."""

    def get_config(self):
        return transformers.GPTJConfig(
            vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.num_hidden_layers,
            n_head=self.num_attention_heads, n_inner=self.intermediate_size, rotary_dim=4, n_positions=512,
            activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
            initializer_range=0.02, pad_token_id=self.pad_token_id, bos_token_id=1, eos_token_id=2)


class PhiTester(LlamaTester):
    """Phi: partial rotary, per-head q/k layer norms, grouped-query heads, biased ``dense`` and LM head."""

    def get_config(self):
        return transformers.PhiConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, partial_rotary_factor=0.5, qk_layernorm=True,
            resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1, max_position_embeddings=512,
            initializer_range=0.02, pad_token_id=self.pad_token_id, bos_token_id=1, eos_token_id=2)
