"""The one table of communication names (stepwatch.profiler.collectives): which host
ops and kernels are communication, what each collective is called, how many bytes it moved."""

from __future__ import annotations

import pytest

from stepwatch.profiler.collectives import (
    OPS,
    host_op_bytes,
    is_comm_kernel_name,
    is_launcher,
    normalize_op,
    tensor_bytes,
)


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("gloo:all_reduce", "all_reduce"),
        ("c10d::allreduce_", "all_reduce"),
        ("allreduce_coalesced", "all_reduce"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "all_reduce"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, ncclWorkElem)", "all_reduce"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
        ("gloo:all_gather", "all_gather"),
        ("c10d::_allgather_base_", "all_gather"),
        ("allgather_into_tensor_coalesced", "all_gather"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "all_gather"),
        ("gloo:broadcast", "broadcast"),
        ("ncclDevKernel_Broadcast_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "broadcast"),
        ("gloo:all_to_all", "all_to_all"),
        ("c10d::alltoall_base_", "all_to_all"),
        ("all_to_allv", "all_to_all"),
        ("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", "send_recv"),
        ("gloo:send", "send"),
        ("c10d::recv_", "recv"),
        ("c10d::recv_any_source_", "recv"),
        ("gloo:barrier", "barrier"),
        ("c10d::monitored_barrier_", "barrier"),
        ("gloo:reduce", "reduce"),
        ("c10d::gather_", "gather"),
        ("gloo:scatter", "scatter"),
        ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "other"),
        # older PyTorch host ops and NCCL annotations (HTA's A100 / V100 traces)
        ("nccl:all_to_all", "all_to_all"),
        ("nccl:_all_gather_base", "all_gather"),
        ("nccl:_reduce_scatter_base", "reduce_scatter"),
        ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", "send_recv"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),
        # functional collectives, symmetric memory, custom all-reduce, MoE all-to-all
        ("_c10d_functional::all_gather_into_tensor", "all_gather"),
        ("_c10d_functional::reduce_scatter_tensor", "reduce_scatter"),
        ("symm_mem::multimem_all_reduce_", "all_reduce"),
        ("symm_mem::two_shot_all_reduce_", "all_reduce"),
        ("symm_mem::fused_all_gather_matmul", "all_gather"),
        ("symm_mem::all_to_all_vdev", "all_to_all"),
        ("void c10d::symmetric_memory::multimem_all_reduce_kernel<c10::BFloat16, 16>", "all_reduce"),
        ("void vllm::cross_device_reduce_1stage<half, 8>(vllm::RankData*)", "all_reduce"),
        ("void tensorrt_llm::kernels::oneShotAllReduceKernel<half, 8>(AllReduceParams)", "all_reduce"),
        ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*)", "all_to_all"),
        ("void deep_ep::internode_ll::combine<false>(void*, int*)", "all_to_all"),
        ("record_param_comms", "other"),
    ],
)
def test_normalize_op(name: str, op: str) -> None:
    assert normalize_op(name) == op
    assert op in OPS


@pytest.mark.parametrize(
    "name",
    [
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)",
        "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",  # RCCL / NCCL 2.20+
        "void c10d::symmetric_memory::multimem_all_reduce_kernel<c10::BFloat16, 16>",
        "void c10d::symmetric_memory::two_shot_all_reduce_kernel<float, 4>",
        "void deep_ep::internode::dispatch<true, 8>(int4*)",
        "void nvshmemi_transfer_rma_kernel<1>(void*)",
        "void pplx::a2a_dispatch_kernel<16>(...)",
        "void vllm::cross_device_reduce_2stage<half, 8>(vllm::RankData*)",
        "void tensorrt_llm::kernels::twoShotAllReduceKernel<half>(AllReduceParams)",
        "void mscclpp::allreduce_kernel<float>(...)",
    ],
)
def test_communication_kernels_by_name(name: str) -> None:
    assert is_comm_kernel_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_segment_k_off_kernel__5x_cublas",
        "void at::native::reduce_kernel<512, 1>(at::native::ReduceOp<float>)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
        "void at::native::index_elementwise_kernel<128, 4>(int, at::native::gpu_index_kernel)",
        "triton_red_fused_native_layer_norm_0",
        "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4>>",
    ],
)
def test_compute_kernels_are_not_communication(name: str) -> None:
    assert not is_comm_kernel_name(name)


def test_launchers() -> None:
    for name in (
        "c10d::allreduce_",
        "nccl:all_to_all",
        "symm_mem::multimem_all_reduce_",
        "record_param_comms",
    ):
        assert is_launcher(name)
    for name in ("aten::mm", "DistributedDataParallel.forward", "ProfilerStep#3", "cudaLaunchKernel"):
        assert not is_launcher(name)


def test_tensor_bytes_skip_what_is_not_a_sized_tensor() -> None:
    args = {"Input Dims": [[2, 3], [], [4]], "Input type": ["c10::BFloat16", "Scalar", "long int"]}
    assert tensor_bytes(args) == [12, 32]
    assert tensor_bytes({"Input Dims": [[]], "Input type": ["TensorList"]}) is None
    assert tensor_bytes({"Input Dims": [[3]], "Input type": ["float", "float"]}) is None


def test_host_op_bytes_follow_the_nccl_tests_convention() -> None:
    base = (
        "c10d::_allgather_base_",
        {"Input Dims": [[65536, 64], [8192, 64]], "Input type": ["float", "float"]},
    )
    assert host_op_bytes([base], "all_gather", None) == 65536 * 64 * 4, "the gathered output"
    rs = (
        "c10d::_reduce_scatter_base_",
        {"Input Dims": [[8192, 384], [65536, 384]], "Input type": ["float"] * 2},
    )
    assert host_op_bytes([rs], "reduce_scatter", 8) == 65536 * 384 * 4, "the full input"
    nccl = ("nccl:all_reduce", {"Input Dims": [[366336]], "Input type": ["float"]})
    c10d = ("c10d::allreduce_", {"Input Dims": [[], []], "Input type": ["TensorList", ""]})
    assert host_op_bytes([c10d, nccl], "all_reduce", None) == 366336 * 4
    gather = ("nccl:all_gather", {"Input Dims": [[10]], "Input type": ["float"]})
    assert host_op_bytes([gather], "all_gather", 4) == 160
    assert host_op_bytes([gather], "all_gather", None) is None, "unknown group: unknown bytes"
    assert host_op_bytes([("record_param_comms", {})], "all_reduce", 2) is None
