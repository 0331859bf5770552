"""Which of ``transformers``' common model tests run by default (see ``conftest.py``)."""

# What `make test` runs by default: the tests of the contract this project promises (outputs, tuples, resizing,
# embeddings, loading/saving options, dtype rules, training). OSLO_HF_TESTS=full runs all of ModelTesterMixin
# (about 4x longer); see conftest.py.
CORE = {
    "test_attention_outputs", "test_hidden_states_output", "test_retain_grad_hidden_states_attentions",
    "test_model_outputs_equivalence", "test_resize_tokens_embeddings", "test_resize_embeddings_untied",
    "test_model_get_set_embeddings", "test_save_load", "test_load_save_without_tied_weights",
    "test_can_load_ignoring_mismatched_shapes", "test_load_with_mismatched_shapes", "test_problem_types",
    "test_keep_in_fp32_modules", "test_can_set_attention_dynamically",  # torch_dtype: test_contract_options
    "test_training", "test_inputs_embeds_matches_input_ids", "test_correct_missing_keys",
    "test_causal_lm_loss_honors_shift_labels", "test_determinism", "test_model_main_input_name",
    "test_cannot_load_with_meta_device_context_manager", "test_tied_weights_keys",
}
