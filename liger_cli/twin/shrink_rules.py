"""The rules a tiny twin's config is shrunk by, as data: which attributes are sizes and how small each
becomes, which settings make layers differ, and which attributes hold token ids. `shrink.py` applies
them (`shrink_config`); this module holds tables only (the interval rules are one-line predicates).

The rules go by attribute name, not by model family, so that configs never seen before (remote code
included) shrink too: hidden ~64, heads 4, kv heads 2 (1 stays 1: MQA; equal to the heads stays equal:
MHA), head_dim 16, intermediate 96, MoE / shared-expert intermediate 32, MLA ranks 32, SSM and
linear-attention dims small, vocab 256, experts 4, top-k 2 (expert groups 2, top-k group 1), sliding
windows 8. Values that are already small stay; a size that is None stays None.
"""

from __future__ import annotations

from collections.abc import Callable

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, EXPERT_INTERMEDIATE = 64, 4, 2, 16, 96, 32
VOCAB, EXPERTS, TOP_K, RANK, WINDOW, MAX_POSITIONS = 256, 4, 2, 32, 8, 256

# --- widths ---------------------------------------------------------------------------------------------
# Each name maps to the largest value it keeps; smaller values (and None) stay as they are.
CAPS: tuple[tuple[int, str], ...] = (
    (
        HIDDEN,
        "hidden_size d_model n_embd dim emb_dim embedding_dim embedding_size lru_width word_embed_proj_dim "
        "input_embedding_size output_embedding_size router_hidden_size cross_attention_hidden_size "
        "projection_dim text_hidden_size hidden_dim hidden_size_global nemo_conv_channels ext_pw_out_channel "
        "depthwise_separable_out_channel output_channels",
    ),
    (
        HEADS,
        "num_attention_heads n_head n_heads num_heads attention_heads encoder_attention_heads "
        "decoder_attention_heads num_decoder_attention_heads num_encoder_attention_heads swa_num_attention_heads "
        "index_n_heads indexer_n_heads linear_num_heads heads_per_ngram",
    ),
    (
        HEAD_DIM,
        "head_dim attention_head_dim d_head kv_channels dim_head attention_head_size swa_head_dim linear_head_dim "
        "linear_key_head_dim linear_value_head_dim index_head_dim indexer_head_dim v_head_dim qk_nope_head_dim "
        "d_rel global_head_dim",
    ),
    (8, "qk_rope_head_dim rotary_dim rotary_emb_dim mamba_d_head mamba_head_dim mamba_headdim"),
    (
        INTERMEDIATE,
        "intermediate_size ffn_dim n_inner d_inner dff dim_ff feed_forward_size ffn_hidden_size encoder_ffn_dim "
        "decoder_ffn_dim intermediate_size_mlp dense_intermediate_size prefix_dense_intermediate_size "
        "attention_hidden_size mlp_dim",
    ),
    (
        EXPERT_INTERMEDIATE,
        "moe_intermediate_size expert_ffn_hidden_size shared_expert_intermediate_size "
        "moe_shared_expert_intermediate_size shared_experts_intermediate_size shared_intermediate_size "
        "moe_latent_size",
    ),
    (
        RANK,
        "q_lora_rank kv_lora_rank o_lora_rank adapter_rank laurel_rank time_step_rank mamba_dt_rank "
        "gated_norm_rank hc_lowrank hidden_size_per_layer_input ple_embed_dim pronunciation_embed_dim "
        "shape_embed_dim prompt_mid_dim index_topk indexer_budget",
    ),
    (16, "state_size ssm_state_size mamba_d_state mamba_d_ssm"),
    (EXPERTS, "num_experts num_local_experts n_routed_experts moe_num_experts zero_expert_num"),
    (
        TOP_K,
        "num_experts_per_tok num_experts_per_token moe_topk moe_k top_k_experts moe_top_k num_selected_experts",
    ),
    (1, "n_shared_experts num_shared_experts moe_num_shared_experts topk_group"),
    (2, "n_group num_expert_group n_groups mamba_n_groups mamba_ngroups num_layers_per_stack"),
    (
        WINDOW,
        "sliding_window sliding_window_size attention_window_size local_attention_window_len attention_chunk_size "
        "local_attn_chunk_length lsh_attn_chunk_length window_size",
    ),
    (32, "chunk_size mamba_chunk_size block_size max_inference_chunksize"),
)
CAP = {name: cap for cap, names in CAPS for name in names.split()}
HEAD_DIMS = set(CAPS[2][1].split() + CAPS[3][1].split())
# Sizes that were equal must stay equal (MLA: head_dim is the rope part; rwkv: attention width is hidden).
TIED = (HEAD_DIMS, set(CAPS[0][1].split()) | {"attention_hidden_size"})
HEAD_NAMES = ("num_attention_heads", "n_head", "n_heads")
# Key/value heads: at most KV_HEADS, 1 stays 1 (MQA), as many as the heads stays so (MHA).
KV_HEAD_NAMES = (
    "num_key_value_heads num_kv_heads swa_num_key_value_heads num_query_groups indexer_kv_heads kv_n_heads "
    "linear_num_key_heads"
).split()
# SSM (heads, head dim) pairs: heads x head dim fill the SSM inner width (expand x hidden) if they did.
SSM_HEADS = (
    ("mamba_n_heads", "mamba_d_head"),
    ("mamba_num_heads", "mamba_head_dim"),
    ("n_mamba_heads", "mamba_headdim"),
    ("num_heads", "head_dim"),
)
SSM_GROUPS = ("mamba_n_groups", "n_groups", "mamba_ngroups")  # must divide the SSM heads, else 1

# --- depth ------------------------------------------------------------------------------------------------
LAYER_NAMES = (
    "num_hidden_layers n_layer n_layers num_layers num_decoder_layers decoder_layers encoder_layers "
    "num_encoder_layers num_blocks"
).split()
# Interval settings: name -> (is layer i "special" under value v, for a model of n layers).
INTERVALS: dict[str, Callable[[int, int, int], bool]] = {
    "first_k_dense_replace": lambda i, v, n: i < v,
    "num_dense_layers": lambda i, v, n: i < v,
    "moe_layer_start_index": lambda i, v, n: i < v,
    "full_attention_interval": lambda i, v, n: (i + 1) % v == 0,
    "sliding_window_pattern": lambda i, v, n: (i + 1) % v == 0,
    "_sliding_window_pattern": lambda i, v, n: (i + 1) % v == 0,
    "global_attn_every_n_layers": lambda i, v, n: i % v == 0,
    "no_rope_layer_interval": lambda i, v, n: (i + 1) % v == 0,
    "decoder_sparse_step": lambda i, v, n: (i + 1) % v == 0,
    "interleave_moe_layer_step": lambda i, v, n: (i + 1) % v == 0,
    "moe_layer_interval": lambda i, v, n: (i + 1) % v == 0,
    "moe_layer_freq": lambda i, v, n: i % v == 0,
    "num_kv_shared_layers": lambda i, v, n: i >= n - v,
    "max_window_layers": lambda i, v, n: i < v,
    "n_layers_per_attn_res_block": lambda i, v, n: i % v == 0,
}
# Interval settings that 0 turns off (no special layer left: 0).
OFF_AT_ZERO = (
    "num_kv_shared_layers",
    "first_k_dense_replace",
    "num_dense_layers",
    "max_window_layers",
    "moe_layer_start_index",
)
# Period/offset pairs: layer i is special when i % period == offset.
PERIODS = (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset"))

# --- vocab, token ids, positions -------------------------------------------------------------------------
VOCAB_NAMES = (
    "vocab_size decoder_vocab_size vocab_size_per_layer_input audio_vocab_size unpadded_vocab_size "
    "ngram_vocab_size_base encoder_hash_byte_group_vocab shape_vocab_size pronunciation_vocab_size codebook_size"
).split()
# Token ids above the new vocab move to its top (the same id to the same place in every sub-config).
TOKEN_SUFFIXES = ("token_id", "token_ids", "token_index", "_token")
TOKEN_NAMES = ("suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids")
# Learned position tables (GPT-2, OPT) shrink to MAX_POSITIONS rows; rope positions are left alone.
POSITION_NAMES = "max_position_embeddings n_positions max_seq_len n_ctx context_length".split()
ROPE_SETTINGS = ("rope_parameters", "rope_scaling")
