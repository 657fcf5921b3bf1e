# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashMLA sparse on a quantized (fp8_ds_mla) cache: which prefill path and
workspace its impl and metadata builder set up, at a NoPE model's 512-wide
latent (GLM5Next) and DeepSeek-V3.2's 576."""

import json
from types import SimpleNamespace

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.v1.attention.backends.mla import flashmla_sparse
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "max_position_embeddings": 32768,
    "qk_rope_head_dim": 0,  # the builder's layers: NoPE
}


@pytest.fixture
def sparse_mla(tmp_path, monkeypatch, dist_init):
    """Builds FlashMLASparseImpl, or its metadata builder, for a layer with
    `num_heads` heads per rank and `rope` RoPE dims (0: NoPE) under an engine
    config of 32,768 tokens; only the device's SM count is given."""
    monkeypatch.setattr(flashmla_sparse, "num_compute_units", lambda *_: 132)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_workspace_manager(device)
    config = EngineArgs(
        str(tmp_path),
        enable_prefix_caching=False,
        max_model_len=32768,
        max_num_batched_tokens=16384,
    ).create_engine_config()

    def impl(num_heads=8, rope=0, cache="fp8_ds_mla"):
        with set_current_vllm_config(config):
            return flashmla_sparse.FlashMLASparseImpl(
                num_heads=num_heads,
                head_size=512 + rope,
                scale=1.0,
                num_kv_heads=1,
                alibi_slopes=None,
                sliding_window=None,
                kv_cache_dtype=cache,
                logits_soft_cap=None,
                attn_type="decoder",
                kv_sharing_target_layer_name=None,
                q_lora_rank=None,
                kv_lora_rank=512,
                qk_nope_head_dim=192 - rope,
                qk_rope_head_dim=rope,
                qk_head_dim=192,
                v_head_dim=128,
                kv_b_proj=ColumnParallelLinear(512, num_heads * 256, bias=False),
                topk_indices_buffer=torch.empty(0, 2048, dtype=torch.int32),
            )

    def builder(spec_cache="fp8_ds_mla", rope=0):
        layer = SimpleNamespace(prefill_backend=None, use_shardq=False)
        config.compilation_config.static_forward_context["layer"] = layer
        spec = MLAAttentionSpec(
            block_size=64,
            num_kv_heads=1,
            head_size=512 + rope,
            dtype=torch.uint8,
            cache_dtype_str=spec_cache,
        )
        return flashmla_sparse.FlashMLASparseMetadataBuilder(
            spec, ["layer"], config, device
        )

    yield SimpleNamespace(impl=impl, builder=builder, config=config)
    reset_workspace_manager()


# the group's cache dtype, the engine's: whether the builder plans fp8_ds_mla
GROUP_DTYPES = {
    "bf16-group-beside-fp8": ("auto", "fp8_ds_mla", False),
    "fp8-group-beside-bf16": ("fp8_ds_mla", "auto", True),
}


@pytest.mark.parametrize("case", list(GROUP_DTYPES))
def test_builder_reads_its_group_cache_dtype(sparse_mla, case):
    group, engine, fp8 = GROUP_DTYPES[case]
    sparse_mla.config.cache_config.cache_dtype = engine
    assert sparse_mla.builder(spec_cache=group).use_fp8_kv_cache is fp8


def test_nope_fp8_ds_mla_takes_dense_mha_prefill(sparse_mla):
    impl = sparse_mla.impl()
    assert impl.q_head_size == 576
    assert impl.supports_dense_mha_prefill


def test_nope_fp8_ds_mla_context_workspace_holds_whole_rows(sparse_mla):
    workspace = sparse_mla.builder().chunked_prefill_workspace
    assert workspace.shape[-1] == 576


@pytest.mark.parametrize(
    ("num_heads", "rope"), [(8, 0), (16, 64)], ids=["glm5next-tp8", "deepseek-v32-tp8"]
)
def test_mixed_batch_reserves_one_chunk_and_no_prefill_path(
    sparse_mla, num_heads, rope
):
    impl = sparse_mla.impl(num_heads, rope)
    tokens = sparse_mla.config.scheduler_config.max_num_batched_tokens
    shapes = [shape for shape, _ in impl.workspace_specs]
    assert shapes == [(tokens, num_heads, 576), (1024, 64, 576), (1024, 64, 512)]


def test_separate_path_keeps_its_prefill_workspace(sparse_mla):
    impl = sparse_mla.impl(num_heads=64, rope=64)
    tokens = sparse_mla.config.scheduler_config.max_num_batched_tokens
    shapes = [shape for shape, _ in impl.workspace_specs]
    prefill = [(5 * 32768, 576), (tokens, 64, 576), (tokens, 64, 512)]
    assert shapes[1:] == [*prefill, (tokens, 64, 512)]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="FlashMLA's SM90 sparse FP8 decode kernel",
)
def test_mixed_batch_in_chunks_matches_one_call(sparse_mla):
    from vllm import _custom_ops as ops

    impl, gen = sparse_mla.impl(), torch.Generator("cuda").manual_seed(0)
    tokens, rows = 3 * flashmla_sparse.FP8_MIXED_BATCH_CHUNK + 77, 64 * 64
    cache = torch.zeros(64, 64, 656, dtype=torch.uint8, device="cuda")
    kv_c = torch.randn(rows, 512, generator=gen, device="cuda").bfloat16()
    scale = torch.ones(1, device="cuda")
    slots = torch.arange(rows, device="cuda")
    ops.concat_and_cache_mla(kv_c, kv_c[:, :0], cache, slots, "fp8_ds_mla", scale)
    q = torch.randn(tokens, 8, 576, generator=gen, device="cuda").bfloat16()
    q[..., 512:] = 0
    indices = torch.randint(0, rows, (tokens, 2176), generator=gen, device="cuda")
    indices = indices.int().masked_fill(indices % 5 == 0, -1)

    def metadata():
        return flashmla_sparse.FlashMLASparseMetadata.FP8KernelMetadata(
            scheduler_metadata=flashmla_sparse.get_mla_metadata()[0],
            dummy_block_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
            cache_lens=torch.full((1,), 32768, dtype=torch.int32, device="cuda"),
            tail_scheduler_metadata=flashmla_sparse.get_mla_metadata()[0],
        )

    out, lse = impl._fp8_mixed_batch_kernel(q, cache, indices, metadata())
    one_out, one_lse = impl._fp8_flash_mla_kernel(
        q[None], cache, indices[None], metadata()
    )
    torch.testing.assert_close(out, one_out[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, one_lse, atol=1e-3, rtol=1e-3)
