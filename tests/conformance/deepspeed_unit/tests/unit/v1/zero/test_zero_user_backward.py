# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import pytest
import torch
import deepspeed.comm as dist
import deepspeed
from torch.nn.parallel import DistributedDataParallel as DDP

from unit.common import DistributedTest, preferred_dtype, allclose_on_all_ranks
from unit.simple_model import SimpleModel, random_dataloader
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.ops.aio import AsyncIOBuilder
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum


class SimpleNonScalarModel(torch.nn.Module):
    """Model that returns non-scalar output for testing tensor.backward(grad)"""

    def __init__(self, hidden_dim):
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x):
        # Returns non-scalar output
        x = self.linear1(x)
        x = self.linear2(x)
        return x


class SimpleOutputModel(torch.nn.Module):
    """Model that returns output without computing loss"""

    def __init__(self, hidden_dim):
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x):
        x = self.linear1(x)
        x = self.linear2(x)
        return x


# Frozen-model hidden dim. Used as a persistence threshold too: at this value the 1-D norm
# params (numel == hidden) become persistent (the HF#47254 RMSNorm shape); at 0 all partition.
_FROZEN_HIDDEN_DIM = 8


def get_config_dict(zero_stage, gradient_accumulation_steps=1, force_fp32=False, param_persistence_threshold=0):
    """Build a config dict.

    force_fp32 keeps the engine in fp32: the frozen-param non-reentrant CheckpointError only
    reproduces in fp32 (bf16 recompute takes a different path). param_persistence_threshold
    (ZeRO-3) sets stage3_param_persistence_threshold; 0 partitions all, >= numel stays resident.
    """
    config_dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_print": 1,
        "zero_optimization": {
            "stage": zero_stage,
        },
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3
            }
        },
    }

    if zero_stage == 3:
        config_dict["zero_optimization"]["stage3_param_persistence_threshold"] = param_persistence_threshold

    if not force_fp32:
        if get_accelerator().is_bf16_supported():
            config_dict["bf16"] = {"enabled": True}
        elif get_accelerator().is_fp16_supported():
            config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}

    return config_dict


def collect_gradients_safe(model):
    """Collect gradients from model parameters using safe_get_full_grad API"""
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = safe_get_full_grad(param)
            if grad is not None:
                # Remove 'module.' prefix if present (DeepSpeed wraps the model)
                clean_name = name.replace('module.', '')
                grads[clean_name] = grad.detach().clone().cpu()
    return grads


def initialize_distributed():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    device = get_accelerator().current_device_name()
    rank = get_accelerator().current_device()
    dtype = preferred_dtype()
    return device, rank, dtype


def create_ddp_model(model_class, device, rank, dtype, seed=42, lr=1e-3, **model_kwargs):
    torch.manual_seed(seed)
    model = model_class(**model_kwargs)
    model = model.to(device=device, dtype=dtype)
    model = DDP(model, device_ids=[rank], output_device=rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optimizer


def create_deepspeed_engine(model_class, zero_stage, seed=42, gradient_accumulation_steps=1, **model_kwargs):
    torch.manual_seed(seed)
    model = model_class(**model_kwargs)

    config = get_config_dict(zero_stage, gradient_accumulation_steps=gradient_accumulation_steps)
    engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
    return engine


def create_deepspeed_engine_from_model(model, zero_stage, gradient_accumulation_steps=1):
    config = get_config_dict(zero_stage, gradient_accumulation_steps=gradient_accumulation_steps)
    engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
    return engine


def setup_models_and_engines(model_class, zero_stage, seed=42, lr=1e-3, gradient_accumulation_steps=1, **model_kwargs):
    # Initialize distributed environment
    device, rank, dtype = initialize_distributed()

    # Create DDP model
    model_ddp, optimizer_ddp = create_ddp_model(model_class, device, rank, dtype, seed=seed, lr=lr, **model_kwargs)

    # Create DeepSpeed engine
    model_engine = create_deepspeed_engine(model_class,
                                           zero_stage,
                                           seed=seed,
                                           gradient_accumulation_steps=gradient_accumulation_steps,
                                           **model_kwargs)

    return model_ddp, optimizer_ddp, model_engine, device, dtype


def collect_ddp_gradients(model_ddp):
    """Collect gradients from DDP model"""
    grads = {}
    for name, param in model_ddp.named_parameters():
        if param.grad is not None:
            clean_name = name.replace('module.', '')
            grads[clean_name] = param.grad.detach().clone().cpu()
    return grads


def compare_gradients(grads_ddp, grads_ds, step_info=""):
    """Compare gradients between DDP and DeepSpeed.

    Uses PyTorch's default tolerances for the tensor dtype (e.g., for bfloat16:
    rtol=1.6e-2, atol=1e-5). The 2-layer model keeps differences small enough
    to pass with default tolerances even after multiple optimizer steps.
    """
    step_suffix = f" at {step_info}" if step_info else ""
    assert len(grads_ddp) == len(grads_ds), \
        f"Different number of parameters with gradients{step_suffix}: DDP={len(grads_ddp)}, DeepSpeed={len(grads_ds)}"

    for name in grads_ddp.keys():
        assert name in grads_ds, f"Parameter {name} missing in DeepSpeed gradients{step_suffix}"
        grad_ddp = grads_ddp[name]
        grad_ds = grads_ds[name]
        # If dtypes differ, convert ds to match ddp's dtype
        if grad_ds.dtype != grad_ddp.dtype:
            grad_ds = grad_ds.to(grad_ddp.dtype)
        # Use PyTorch's default tolerances for the dtype
        allclose_on_all_ranks(grad_ddp, grad_ds, assert_message=f"Gradients differ for parameter {name}{step_suffix}")


def collect_ddp_parameters(model_ddp):
    """Collect parameters from DDP model"""
    params = {}
    for name, param in model_ddp.named_parameters():
        clean_name = name.replace('module.', '')
        params[clean_name] = param.detach().clone().cpu()
    return params


def collect_deepspeed_parameters(model_engine, zero_stage):
    """Collect parameters from DeepSpeed engine (handles ZeRO-3 gathering)"""
    params = {}
    for name, param in model_engine.named_parameters():
        clean_name = name.replace('module.', '')
        if zero_stage == 3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                params[clean_name] = param.detach().clone().cpu()
        else:
            params[clean_name] = param.detach().clone().cpu()
    return params


def compare_parameters(params_ddp, params_ds, step_info=""):
    """Compare parameters between DDP and DeepSpeed"""
    step_suffix = f" at {step_info}" if step_info else ""
    assert len(params_ddp) == len(params_ds), \
        f"Parameter count mismatch{step_suffix}: DDP={len(params_ddp)}, DeepSpeed={len(params_ds)}"

    for name in params_ddp.keys():
        assert name in params_ds, f"Parameter {name} missing in DeepSpeed model{step_suffix}"
        # Convert to fp32 for comparison in case of dtype mismatch
        params_ddp_fp32 = params_ddp[name].float()
        params_ds_fp32 = params_ds[name].float()
        allclose_on_all_ranks(params_ddp_fp32,
                              params_ds_fp32,
                              assert_message=f"Parameter {name} mismatch{step_suffix}")


def assert_all_partitioned(model_engine, zero_stage, step_info=""):
    """For ZeRO-3, assert every non-persistent param is released after backward.

    The recompute bug left frozen params gathered after backward, so the release check catches
    regressions a crash-only test misses. Persistent params are skipped (meant to stay
    resident). No-op for stages 1/2.
    """
    if zero_stage != 3:
        return
    step_suffix = f" at {step_info}" if step_info else ""
    for name, param in model_engine.module.named_parameters():
        if param.ds_persist:
            continue
        assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE, \
            f"Parameter {name} not partitioned after backward (status={param.ds_status}){step_suffix}"


def assert_persistent_resident(model_engine, zero_stage, step_info=""):
    """For ZeRO-3, assert every persistent param stays gathered (AVAILABLE) after backward.

    Persistent frozen params are added to a recompute owner during checkpoint recompute; if the
    release path force-releases that owner's recompute set without a ds_persist guard, they get
    partitioned despite stage3_param_persistence_threshold. No-op for stages 1/2 or when nothing
    is persistent. Only meaningful once the trace is complete (skip warmup step 0).
    """
    if zero_stage != 3:
        return
    step_suffix = f" at {step_info}" if step_info else ""
    for name, param in model_engine.module.named_parameters():
        if not param.ds_persist:
            continue
        assert param.ds_status == ZeroParamStatus.AVAILABLE, \
            f"Persistent parameter {name} was partitioned after backward (status={param.ds_status}){step_suffix}"


def run_frozen_checkpoint_comparison(model_cls,
                                     zero_stage,
                                     use_reentrant,
                                     num_iterations=3,
                                     input_requires_grad=True,
                                     leaf_module_types=None,
                                     dtype=torch.float32,
                                     param_persistence_threshold=0,
                                     **model_kwargs):
    """Shared driver for the frozen-param + checkpoint regression tests.

    Each iteration checks: (1) backward runs without CheckpointError, (2) grads match the DDP
    reference, (3) ZeRO-3 releases every non-persistent param after backward.
    param_persistence_threshold toggles the persistent vs non-persistent frozen path.
    """
    hidden_dim = _FROZEN_HIDDEN_DIM
    batch_size = 2

    device, rank, _ = initialize_distributed()
    # fp32 reproduces the pre-fix CheckpointError; bf16 covers the common mixed-precision case.
    if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
        pytest.skip("bf16 is not supported on this accelerator")

    # DDP reference: no parameter partitioning, so no checkpoint metadata issue.
    torch.manual_seed(42)
    model_ddp = model_cls(hidden_dim=hidden_dim, use_reentrant=use_reentrant, **model_kwargs)
    model_ddp = model_ddp.to(device=device, dtype=dtype)
    model_ddp = DDP(model_ddp, device_ids=[rank], output_device=rank)
    optimizer_ddp = torch.optim.Adam([p for p in model_ddp.parameters() if p.requires_grad], lr=1e-3)

    # DeepSpeed engine with ZeRO partitioning. Only trainable params go to the optimizer;
    # the frozen params are still partitioned by ZeRO-3, which is what triggers the failure.
    torch.manual_seed(42)
    model_ds = model_cls(hidden_dim=hidden_dim, use_reentrant=use_reentrant, **model_kwargs)
    if leaf_module_types is not None:
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model_ds, leaf_module_types)
    config = get_config_dict(zero_stage,
                             force_fp32=(dtype == torch.float32),
                             param_persistence_threshold=param_persistence_threshold)
    trainable_params = [p for p in model_ds.parameters() if p.requires_grad]
    model_engine, _, _, _ = deepspeed.initialize(config=config, model=model_ds, model_parameters=trainable_params)

    # Loop several iterations: the release-lifetime regression only shows up once frozen
    # params linger AVAILABLE across steps, so a single step would miss it.
    for iteration in range(num_iterations):
        step_info = f"use_reentrant={use_reentrant}, stage {zero_stage}, iter {iteration}"

        torch.manual_seed(123 + iteration)
        x_ddp = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=input_requires_grad)
        output_ddp = model_ddp(x_ddp)
        output_ddp.backward(torch.ones_like(output_ddp))
        get_accelerator().synchronize()
        dist.barrier()
        ddp_grads = collect_ddp_gradients(model_ddp)

        # Drive backward through the engine so the ZeRO coordinator hooks run; a raw
        # output.backward() bypasses them and would not reproduce the bug.
        torch.manual_seed(123 + iteration)
        x_ds = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=input_requires_grad)
        output_ds = model_engine(x_ds)
        model_engine.backward(output_ds.sum())
        get_accelerator().synchronize()
        dist.barrier()
        ds_grads = collect_gradients_safe(model_engine)

        assert len(ds_grads) > 0, f"No gradients with frozen param, {step_info}"
        # Compare only on step 0: later steps diverge along slightly different Adam trajectories.
        if iteration == 0:
            compare_gradients(ddp_grads, ds_grads, f"frozen-param checkpointing {step_info}")

        # Frozen params must be released (partitioned) after every backward, not left gathered.
        assert_all_partitioned(model_engine, zero_stage, step_info)
        # Persistent params must stay resident; check once the trace is complete (after warmup).
        if iteration >= 1:
            assert_persistent_resident(model_engine, zero_stage, step_info)

        model_engine.step()
        optimizer_ddp.step()
        optimizer_ddp.zero_grad()

    model_engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestZeroUserBackwardBasic(DistributedTest):
    """Test basic functionality of user backward (loss.backward()) by comparing with PyTorch DDP"""
    world_size = 2

    def test_loss_backward_matches_ddp(self, zero_stage):
        """Test that DeepSpeed loss.backward() produces same gradients as PyTorch DDP"""
        hidden_dim = 4

        # Create DDP and DeepSpeed models
        model_ddp, optimizer_ddp, model_engine, device, dtype = setup_models_and_engines(model_class=SimpleModel,
                                                                                         zero_stage=zero_stage,
                                                                                         hidden_dim=hidden_dim,
                                                                                         nlayers=2)

        # Create data
        data_loader = random_dataloader(model=model_engine, total_samples=8, hidden_dim=hidden_dim, device=device)

        # Run one training step with both models
        batch = next(iter(data_loader))

        # DDP: forward and backward
        optimizer_ddp.zero_grad()
        loss_ddp = model_ddp(batch[0], batch[1])
        loss_ddp.backward()
        grads_ddp = collect_ddp_gradients(model_ddp)

        # DeepSpeed: forward and backward
        loss_ds = model_engine(batch[0], batch[1])
        loss_ds.backward()
        grads_ds = collect_gradients_safe(model_engine)

        # Compare gradients
        compare_gradients(grads_ddp, grads_ds)

        model_engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestZeroUserBackwardNonScalar(DistributedTest):
    """Test non-scalar backward support"""
    world_size = 2

    def test_non_scalar_backward(self, zero_stage):
        """Test that tensor.backward(grad) works correctly by comparing with PyTorch DDP"""
        hidden_dim = 4
        batch_size = 2

        # Create DDP and DeepSpeed models
        model_ddp, optimizer_ddp, model_engine, device, dtype = setup_models_and_engines(
            model_class=SimpleNonScalarModel, zero_stage=zero_stage, hidden_dim=hidden_dim)

        # Create input data
        torch.manual_seed(123)
        x = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype)

        # DDP: forward and non-scalar backward
        optimizer_ddp.zero_grad()
        output_ddp = model_ddp(x)
        grad_output = torch.ones_like(output_ddp)
        output_ddp.backward(grad_output)
        ddp_grads = collect_ddp_gradients(model_ddp)

        # DeepSpeed: forward and non-scalar backward
        output_deepspeed = model_engine(x)
        grad_output_ds = torch.ones_like(output_deepspeed)
        output_deepspeed.backward(grad_output_ds)
        deepspeed_grads = collect_gradients_safe(model_engine)

        # Compare gradients
        compare_gradients(ddp_grads, deepspeed_grads, "after non-scalar backward")

        # Run optimizer step
        optimizer_ddp.step()
        model_engine.step()

        # Collect and compare parameters after step
        ddp_params = collect_ddp_parameters(model_ddp)
        deepspeed_params = collect_deepspeed_parameters(model_engine, zero_stage)
        compare_parameters(ddp_params, deepspeed_params, "after non-scalar backward")

        model_engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestZeroUserBackwardGradAccumulation(DistributedTest):
    """Test gradient accumulation with user backward"""
    world_size = 2

    def test_grad_accumulation(self, zero_stage):
        """Test that gradient accumulation works correctly with loss.backward() by comparing with DDP"""
        hidden_dim = 4
        gradient_accumulation_steps = 4

        # Create DDP and DeepSpeed models with gradient accumulation
        model_ddp, optimizer_ddp, model_engine, device, _ = setup_models_and_engines(
            model_class=SimpleModel,
            zero_stage=zero_stage,
            gradient_accumulation_steps=gradient_accumulation_steps,
            hidden_dim=hidden_dim,
            nlayers=2)

        # Create data
        data_loader = random_dataloader(model=model_engine, total_samples=16, hidden_dim=hidden_dim, device=device)

        # Run training with gradient accumulation
        for i, batch in enumerate(data_loader):
            # DDP: Manual gradient accumulation
            loss_ddp = model_ddp(batch[0], batch[1])
            (loss_ddp / gradient_accumulation_steps).backward()

            # DeepSpeed: Built-in gradient accumulation
            loss_ds = model_engine(batch[0], batch[1])
            loss_ds.backward()

            # Compare gradients at accumulation boundary
            if model_engine.is_gradient_accumulation_boundary():
                grads_ddp = collect_ddp_gradients(model_ddp)
                grads_ds = collect_gradients_safe(model_engine)
                compare_gradients(grads_ddp, grads_ds, f"step {i}")

                # Step both optimizers
                optimizer_ddp.step()
                optimizer_ddp.zero_grad()

            # Step DeepSpeed (handles gradient accumulation internally)
            model_engine.step()

        model_engine.destroy()

    def test_grad_accumulation_scale_wrt_gas_false(self, zero_stage):
        """Test that scale_wrt_gas=False disables gradient scaling by accumulation steps.

        When scale_wrt_gas=False is passed to engine.backward(), gradients should NOT be
        scaled by gradient_accumulation_steps. This is useful when users want to handle
        gradient scaling themselves (e.g., using Hugging Face Accelerate).
        """
        hidden_dim = 4
        gradient_accumulation_steps = 4

        # Create DDP and DeepSpeed models with gradient accumulation
        model_ddp, optimizer_ddp, model_engine, device, _ = setup_models_and_engines(
            model_class=SimpleModel,
            zero_stage=zero_stage,
            gradient_accumulation_steps=gradient_accumulation_steps,
            hidden_dim=hidden_dim,
            nlayers=2)

        # Create data
        data_loader = random_dataloader(model=model_engine, total_samples=16, hidden_dim=hidden_dim, device=device)

        # Run training with gradient accumulation but WITHOUT scaling by GAS
        for i, batch in enumerate(data_loader):
            # DDP: Do NOT divide by GAS (since we're testing scale_wrt_gas=False)
            loss_ddp = model_ddp(batch[0], batch[1])
            loss_ddp.backward()

            # DeepSpeed: Use scale_wrt_gas=False to disable gradient scaling
            loss_ds = model_engine(batch[0], batch[1])
            model_engine.backward(loss_ds, scale_wrt_gas=False)

            # Compare gradients at accumulation boundary
            if model_engine.is_gradient_accumulation_boundary():
                grads_ddp = collect_ddp_gradients(model_ddp)
                grads_ds = collect_gradients_safe(model_engine)
                compare_gradients(grads_ddp, grads_ds, f"step {i} with scale_wrt_gas=False")

                # Step both optimizers
                optimizer_ddp.step()
                optimizer_ddp.zero_grad()

            # Step DeepSpeed (handles gradient accumulation internally)
            model_engine.step()

        model_engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestZeroUserBackwardMultipleEngines(DistributedTest):
    """Test multiple DeepSpeed engines with combined loss without manual _backward_epilogue()"""
    world_size = 2

    def test_multiple_engines_combined_loss(self, zero_stage):
        """Test that multiple engines work with combined loss.backward() without manual _backward_epilogue()

        This test compares the behavior with PyTorch DDP baseline to ensure correctness.
        """
        hidden_dim = 4
        batch_size = 2
        num_models = 3
        lr = 1e-3

        # Initialize distributed
        device, rank, dtype = initialize_distributed()

        # Create DDP baseline models
        ddp_models = []
        ddp_optimizers = []
        for i in range(num_models):
            model, optimizer = create_ddp_model(SimpleModel,
                                                device,
                                                rank,
                                                dtype,
                                                seed=42 + i,
                                                lr=lr,
                                                hidden_dim=hidden_dim,
                                                nlayers=2)
            ddp_models.append(model)
            ddp_optimizers.append(optimizer)

        # Create multiple DeepSpeed engines with identical initialization
        model_engines = []
        for i in range(num_models):
            engine = create_deepspeed_engine(SimpleModel, zero_stage, seed=42 + i, hidden_dim=hidden_dim, nlayers=2)
            model_engines.append(engine)

        # Create same input for all models
        torch.manual_seed(123)
        x = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype)
        y = torch.randint(0, hidden_dim, (batch_size, ), device=device)

        # DDP baseline: compute losses and combined backward
        for optimizer in ddp_optimizers:
            optimizer.zero_grad()

        ddp_losses = []
        for model in ddp_models:
            loss = model(x, y)
            ddp_losses.append(loss)

        ddp_combined_loss = sum(l / (i + 1) for i, l in enumerate(ddp_losses))
        ddp_combined_loss.backward()

        # Collect DDP gradients for each model
        ddp_grads_per_model = [collect_ddp_gradients(model) for model in ddp_models]

        # DeepSpeed: compute losses and combined backward WITHOUT manual _backward_epilogue()
        ds_losses = [engine(x, y) for engine in model_engines]
        ds_combined_loss = sum(l / (i + 1) for i, l in enumerate(ds_losses))
        ds_combined_loss.backward()

        # Collect DeepSpeed gradients for each engine and compare with DDP
        for engine_idx, engine in enumerate(model_engines):
            ds_grads = collect_gradients_safe(engine)
            ddp_grads = ddp_grads_per_model[engine_idx]
            assert len(ds_grads) > 0, f"Engine {engine_idx} has no gradients after combined_loss.backward()"
            compare_gradients(ddp_grads, ds_grads, f"Engine {engine_idx}")

        # Step all DDP models
        for optimizer in ddp_optimizers:
            optimizer.step()
            optimizer.zero_grad()

        # Step all DeepSpeed engines
        for engine in model_engines:
            engine.step()
            engine.optimizer.zero_grad()

        # Run another iteration to ensure everything still works
        torch.manual_seed(456)
        x2 = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype)
        y2 = torch.randint(0, hidden_dim, (batch_size, ), device=device)

        # DDP second iteration
        ddp_losses2 = [model(x2, y2) for model in ddp_models]
        ddp_combined_loss2 = sum(l / (i + 1) for i, l in enumerate(ddp_losses2))
        ddp_combined_loss2.backward()
        ddp_grads_per_model2 = [collect_ddp_gradients(model) for model in ddp_models]

        # DeepSpeed second iteration
        ds_losses2 = [engine(x2, y2) for engine in model_engines]
        ds_combined_loss2 = sum(l / (i + 1) for i, l in enumerate(ds_losses2))
        ds_combined_loss2.backward()

        # Verify gradients again and compare with DDP
        for engine_idx, engine in enumerate(model_engines):
            ds_grads = collect_gradients_safe(engine)
            ddp_grads = ddp_grads_per_model2[engine_idx]
            assert len(ds_grads) > 0, f"Engine {engine_idx} has no gradients in second iteration"
            compare_gradients(ddp_grads, ds_grads, f"Engine {engine_idx} (iter 2)")

        # Step both
        for optimizer in ddp_optimizers:
            optimizer.step()

        for engine in model_engines:
            engine.step()

        # Cleanup
        for engine in model_engines:
            engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestZeroUserBackwardSeparateLoss(DistributedTest):
    """Test using separate loss functions"""
    world_size = 2

    def test_separate_loss_function(self, zero_stage):
        """Test that separate loss function works correctly by comparing with PyTorch DDP"""
        hidden_dim = 4
        batch_size = 2

        # Create DDP and DeepSpeed models
        model_ddp, optimizer_ddp, model_engine, device, dtype = setup_models_and_engines(model_class=SimpleOutputModel,
                                                                                         zero_stage=zero_stage,
                                                                                         hidden_dim=hidden_dim)

        # Define loss function separately
        loss_fn = torch.nn.CrossEntropyLoss()

        # Create input data
        torch.manual_seed(456)
        x = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype)
        y = torch.randint(0, hidden_dim, (batch_size, ), device=device)

        # DDP: forward, loss, backward
        optimizer_ddp.zero_grad()
        output_ddp = model_ddp(x)
        loss_ddp = loss_fn(output_ddp, y)
        loss_ddp.backward()
        grads_ddp = collect_ddp_gradients(model_ddp)

        # DeepSpeed: forward, loss, backward
        output_ds = model_engine(x)
        loss_ds = loss_fn(output_ds, y)
        loss_ds.backward()
        grads_ds = collect_gradients_safe(model_engine)

        # Compare gradients
        compare_gradients(grads_ddp, grads_ds)

        model_engine.destroy()


class LeafModuleModel(torch.nn.Module):
    """Model with ModuleList that uses all parameters - for testing leaf module compatibility"""

    def __init__(self, hidden_dim):
        super().__init__()
        # ModuleList where all branches are used in forward pass
        self.branches = torch.nn.ModuleList([
            torch.nn.Linear(hidden_dim, hidden_dim),
            torch.nn.Linear(hidden_dim, hidden_dim),
        ])
        self.final_layer = torch.nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x, y):
        # Use all branches - add their outputs together
        x = self.branches[0](x) + self.branches[1](x)
        x = self.final_layer(x)
        loss = torch.nn.functional.cross_entropy(x, y)
        return loss


class LeafNonScalarModel(torch.nn.Module):
    """Leaf module model that returns non-scalar output"""

    def __init__(self, hidden_dim):
        super().__init__()
        self.branches = torch.nn.ModuleList([
            torch.nn.Linear(hidden_dim, hidden_dim),
            torch.nn.Linear(hidden_dim, hidden_dim),
        ])

    def forward(self, x):
        # Use all branches - returns non-scalar output
        return self.branches[0](x) + self.branches[1](x)


@pytest.mark.parametrize("zero_stage", [3])
class TestZeroUserBackwardLeafModule(DistributedTest):
    """Test leaf module behavior during backward passes in ZeRO Stage 3"""
    world_size = 2

    def test_leaf_module_backward(self, zero_stage):
        """Test that leaf modules work correctly with user backward by comparing with PyTorch DDP

        This test validates that the leaf_module_count and backward hooks are correctly
        handled in create_reduce_and_remove_grad_hooks.
        """
        from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module

        hidden_dim = 4
        batch_size = 2
        lr = 1e-3

        # Initialize distributed environment
        device, rank, dtype = initialize_distributed()

        # Create DDP model
        model_ddp, optimizer_ddp = create_ddp_model(LeafModuleModel,
                                                    device,
                                                    rank,
                                                    dtype,
                                                    seed=42,
                                                    lr=lr,
                                                    hidden_dim=hidden_dim)

        # Create DeepSpeed model and mark leaf modules BEFORE initialization
        torch.manual_seed(42)
        model_deepspeed = LeafModuleModel(hidden_dim=hidden_dim)
        leaf_modules = set_z3_leaf_modules(model_deepspeed, [torch.nn.ModuleList])
        assert len(leaf_modules) == 1, "Expected exactly one ModuleList to be marked as leaf"
        assert z3_leaf_module(model_deepspeed.branches), "ModuleList should be marked as leaf module"

        # Initialize DeepSpeed engine from the prepared model
        model_engine = create_deepspeed_engine_from_model(model_deepspeed, zero_stage)

        # Verify leaf_module_count was set correctly
        assert len(model_engine.optimizer.leaf_parameters) == 1, \
            "Expected 1 leaf module in optimizer.leaf_parameters"

        # Create input data
        torch.manual_seed(123)
        x = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype)
        y = torch.randint(0, hidden_dim, (batch_size, ), device=device)

        # DDP: forward and backward
        optimizer_ddp.zero_grad()
        loss_ddp = model_ddp(x, y)
        loss_ddp.backward()
        ddp_grads = collect_ddp_gradients(model_ddp)

        # DeepSpeed: forward and backward with leaf module
        loss_deepspeed = model_engine(x, y)
        loss_deepspeed.backward()
        deepspeed_grads = collect_gradients_safe(model_engine)

        # Compare gradients
        compare_gradients(ddp_grads, deepspeed_grads, "with leaf modules")

        model_engine.destroy()

    def test_leaf_module_non_scalar_backward(self, zero_stage):
        """Test that leaf modules work correctly with non-scalar backward (tensor.backward(grad))

        This specifically tests the interaction between leaf modules and non-scalar backward.
        """
        from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module

        hidden_dim = 4
        batch_size = 2
        lr = 1e-3

        # Initialize distributed environment
        device, rank, dtype = initialize_distributed()

        # Create DDP model
        model_ddp, optimizer_ddp = create_ddp_model(LeafNonScalarModel,
                                                    device,
                                                    rank,
                                                    dtype,
                                                    seed=42,
                                                    lr=lr,
                                                    hidden_dim=hidden_dim)

        # Create DeepSpeed model and mark leaf modules BEFORE initialization
        torch.manual_seed(42)
        model_deepspeed = LeafNonScalarModel(hidden_dim=hidden_dim)
        leaf_modules = set_z3_leaf_modules(model_deepspeed, [torch.nn.ModuleList])
        assert len(leaf_modules) == 1, "Expected exactly one ModuleList to be marked as leaf"
        assert z3_leaf_module(model_deepspeed.branches), "ModuleList should be marked as leaf module"

        # Initialize DeepSpeed engine from the prepared model
        model_engine = create_deepspeed_engine_from_model(model_deepspeed, zero_stage)

        # Verify leaf_module_count was set correctly
        assert len(model_engine.optimizer.leaf_parameters) == 1, \
            "Expected 1 leaf module in optimizer.leaf_parameters"

        # Create input data
        torch.manual_seed(123)
        x = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype)

        # DDP: forward and non-scalar backward
        optimizer_ddp.zero_grad()
        output_ddp = model_ddp(x)
        grad_output = torch.ones_like(output_ddp)
        output_ddp.backward(grad_output)
        ddp_grads = collect_ddp_gradients(model_ddp)

        # DeepSpeed: forward and non-scalar backward with leaf module
        output_deepspeed = model_engine(x)
        grad_output_ds = torch.ones_like(output_deepspeed)
        output_deepspeed.backward(grad_output_ds)
        deepspeed_grads = collect_gradients_safe(model_engine)

        # Compare gradients
        compare_gradients(ddp_grads, deepspeed_grads, "in leaf module non-scalar backward")

        model_engine.destroy()


@pytest.mark.sequential
class TestZeroUserBackwardScaleErrorDetection(DistributedTest):
    """Test error detection for missing scale() with fp16 in single-process setup"""
    world_size = 1  # Use single process to avoid distributed deadlock issues

    def test_error_when_backward_without_scale_sequential(self):
        """Test that error is raised when calling backward() without scale() with fp16"""
        if not get_accelerator().is_fp16_supported():
            pytest.skip("Test requires fp16 support")

        hidden_dim = 4
        zero_stage = 1  # Use ZeRO stage 1 for simplicity

        # Initialize distributed
        device, _, _ = initialize_distributed()

        # Create engine with fp16 - requires scaling
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1,
            "zero_optimization": {
                "stage": zero_stage,
            },
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-3
                }
            },
            "fp16": {
                "enabled": True,
                "initial_scale_power": 8
            }
        }

        model_engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        # Verify needs_scaler is True
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
        assert isinstance(model_engine.optimizer, ZeROOptimizer)
        assert model_engine.optimizer.needs_scaler(), "fp16 should require scaling"

        # Create data
        data_loader = random_dataloader(model=model_engine,
                                        total_samples=8,
                                        hidden_dim=hidden_dim,
                                        device=device,
                                        dtype=torch.float16)
        batch = next(iter(data_loader))

        loss = model_engine(batch[0], batch[1])

        # Calling backward() without scale() should raise RuntimeError
        with pytest.raises(RuntimeError, match="Loss scaling is required"):
            loss.backward()

        model_engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 3])
class TestZeroUserBackwardWithScale(DistributedTest):
    """Test engine.scale() method for manual backward passes with loss scaling"""
    world_size = 2

    def test_scale_backward_matches_engine_backward(self, zero_stage):
        """Test that engine.scale(loss).backward() produces same gradients as engine.backward(loss)"""
        hidden_dim = 4

        # Create DeepSpeed engines with same seed
        model_engine1 = create_deepspeed_engine(model_class=SimpleModel,
                                                zero_stage=zero_stage,
                                                seed=42,
                                                hidden_dim=hidden_dim,
                                                nlayers=2)
        model_engine2 = create_deepspeed_engine(model_class=SimpleModel,
                                                zero_stage=zero_stage,
                                                seed=42,
                                                hidden_dim=hidden_dim,
                                                nlayers=2)

        # Create data
        device = get_accelerator().current_device_name()
        data_loader = random_dataloader(model=model_engine1, total_samples=8, hidden_dim=hidden_dim, device=device)
        batch = next(iter(data_loader))

        # Model 1: use engine.backward(loss)
        loss1 = model_engine1(batch[0], batch[1])
        model_engine1.backward(loss1)
        grads1 = collect_gradients_safe(model_engine1)

        # Model 2: use engine.scale(loss).backward()
        loss2 = model_engine2(batch[0], batch[1])
        scaled_loss = model_engine2.scale(loss2)
        scaled_loss.backward()
        grads2 = collect_gradients_safe(model_engine2)

        # Compare gradients - they should be identical
        compare_gradients(grads1, grads2, "comparing engine.backward vs engine.scale().backward()")

        model_engine1.destroy()
        model_engine2.destroy()

    def test_scale_backward_matches_ddp(self, zero_stage):
        """Test that engine.scale(loss).backward() produces same gradients as DDP"""
        hidden_dim = 4

        # Create DDP and DeepSpeed models
        model_ddp, optimizer_ddp, model_engine, device, dtype = setup_models_and_engines(model_class=SimpleModel,
                                                                                         zero_stage=zero_stage,
                                                                                         hidden_dim=hidden_dim,
                                                                                         nlayers=2)

        # Create data
        data_loader = random_dataloader(model=model_engine, total_samples=8, hidden_dim=hidden_dim, device=device)
        batch = next(iter(data_loader))

        # DDP: forward and backward
        optimizer_ddp.zero_grad()
        loss_ddp = model_ddp(batch[0], batch[1])
        loss_ddp.backward()
        grads_ddp = collect_ddp_gradients(model_ddp)

        # DeepSpeed: forward and scale + backward
        loss_ds = model_engine(batch[0], batch[1])
        scaled_loss = model_engine.scale(loss_ds)
        scaled_loss.backward()
        grads_ds = collect_gradients_safe(model_engine)

        # Compare gradients
        compare_gradients(grads_ddp, grads_ds, "comparing DDP vs engine.scale().backward()")

        model_engine.destroy()

    def test_scale_with_gradient_accumulation(self, zero_stage):
        """Test that engine.scale() works correctly with gradient accumulation"""
        hidden_dim = 4
        gradient_accumulation_steps = 4

        # Create models with gradient accumulation
        model_ddp, optimizer_ddp, model_engine, device, _ = setup_models_and_engines(
            model_class=SimpleModel,
            zero_stage=zero_stage,
            gradient_accumulation_steps=gradient_accumulation_steps,
            hidden_dim=hidden_dim,
            nlayers=2)

        # Create data
        data_loader = random_dataloader(model=model_engine, total_samples=16, hidden_dim=hidden_dim, device=device)

        # Run gradient accumulation steps
        for i, batch in enumerate(data_loader):
            # DDP: manual gradient accumulation
            loss_ddp = model_ddp(batch[0], batch[1])
            # Scale by GAS for DDP to match DeepSpeed behavior
            (loss_ddp / gradient_accumulation_steps).backward()

            # DeepSpeed: use scale() with built-in gradient accumulation
            # Note: scale() only applies loss scaler, NOT GAS. DeepSpeed handles GAS internally
            # via engine.step(), so we do NOT manually divide by GAS here.
            loss_ds = model_engine(batch[0], batch[1])
            scaled_loss = model_engine.scale(loss_ds)
            scaled_loss.backward()

            # Compare gradients at accumulation boundary
            if model_engine.is_gradient_accumulation_boundary():
                grads_ddp = collect_ddp_gradients(model_ddp)
                grads_ds = collect_gradients_safe(model_engine)
                compare_gradients(grads_ddp, grads_ds, f"step {i}")

                # Step both optimizers
                optimizer_ddp.step()
                optimizer_ddp.zero_grad()

            # Step DeepSpeed (handles gradient accumulation internally)
            model_engine.step()

        model_engine.destroy()

    def test_needs_scaler_with_fp16(self, zero_stage):
        """Test that needs_scaler() correctly identifies when scaling is required with fp16"""
        if not get_accelerator().is_fp16_supported():
            pytest.skip("Test requires fp16 support for gradient scaling")

        hidden_dim = 4

        # Initialize distributed first
        device, _, _ = initialize_distributed()

        # Create engine with fp16 explicitly to test gradient scaling requirement
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1,
            "zero_optimization": {
                "stage": zero_stage,
            },
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-3
                }
            },
            # Explicitly enable fp16 to test gradient scaling requirement
            "fp16": {
                "enabled": True,
                "initial_scale_power": 8
            }
        }

        if zero_stage == 3:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0

        model_engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        # Verify that the optimizer correctly reports it needs scaling with fp16
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
        assert isinstance(model_engine.optimizer, ZeROOptimizer), "Optimizer should be ZeROOptimizer"
        assert model_engine.optimizer.needs_scaler(), "fp16 configuration should require gradient scaling"

        # Verify scale() method works correctly
        data_loader = random_dataloader(model=model_engine,
                                        total_samples=8,
                                        hidden_dim=hidden_dim,
                                        device=device,
                                        dtype=torch.float16)
        batch = next(iter(data_loader))
        loss = model_engine(batch[0], batch[1])

        # Should be able to use scale() method and get a valid scaled tensor
        scaled_loss = model_engine.scale(loss)
        assert scaled_loss is not None, "scale() should return a scaled loss tensor"
        assert scaled_loss.requires_grad, "scaled loss should require grad"

        model_engine.destroy()

    def test_needs_scaler_with_bf16(self, zero_stage):
        """Test that needs_scaler() correctly identifies that bf16 does NOT require scaling"""
        if not get_accelerator().is_bf16_supported():
            pytest.skip("Test requires bf16 support")

        hidden_dim = 4

        # Initialize distributed first
        device, _, _ = initialize_distributed()

        # Create engine with bf16 to verify scaling is NOT required
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1,
            "zero_optimization": {
                "stage": zero_stage,
            },
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-3
                }
            },
            # Use bf16 which does NOT require gradient scaling
            "bf16": {
                "enabled": True
            }
        }

        if zero_stage == 3:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0

        model_engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        # Verify that the optimizer correctly reports it does NOT need scaling with bf16
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
        assert isinstance(model_engine.optimizer, ZeROOptimizer), "Optimizer should be ZeROOptimizer"
        assert not model_engine.optimizer.needs_scaler(), "bf16 configuration should NOT require gradient scaling"

        # Verify that loss.backward() can be called directly without scale() for bf16
        data_loader = random_dataloader(model=model_engine,
                                        total_samples=8,
                                        hidden_dim=hidden_dim,
                                        device=device,
                                        dtype=torch.bfloat16)
        batch = next(iter(data_loader))
        loss = model_engine(batch[0], batch[1])

        # With bf16, should be able to call backward directly (no scaling required)
        loss.backward()

        # Collect gradients to verify backward completed successfully
        grads = collect_gradients_safe(model_engine)
        assert len(grads) > 0, "Expected gradients to be computed"

        model_engine.destroy()

    def test_error_when_backward_without_scale_fp16(self, zero_stage):
        """Test that calling backward() without scale() raises an error with fp16"""
        if not get_accelerator().is_fp16_supported():
            pytest.skip("Test requires fp16 support for gradient scaling")

        hidden_dim = 4

        # Initialize distributed first
        device, _, _ = initialize_distributed()

        # Create engine with fp16
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1,
            "zero_optimization": {
                "stage": zero_stage,
            },
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-3
                }
            },
            "fp16": {
                "enabled": True,
                "initial_scale_power": 8
            }
        }

        if zero_stage == 3:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0

        model_engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        # Verify needs_scaler is True
        assert model_engine.optimizer.needs_scaler(), "fp16 should require scaling"

        # Create data
        data_loader = random_dataloader(model=model_engine,
                                        total_samples=8,
                                        hidden_dim=hidden_dim,
                                        device=device,
                                        dtype=torch.float16)
        batch = next(iter(data_loader))

        loss = model_engine(batch[0], batch[1])

        # Try to call backward without scale - should raise RuntimeError
        error_raised = False
        try:
            loss.backward()
        except RuntimeError as e:
            if "Loss scaling is required" in str(e):
                error_raised = True
            else:
                raise  # Re-raise if it's a different error

        # If the test completes (doesn't hang), verify error was raised
        if error_raised:
            # Success - error was properly detected
            pass
        else:
            # If no error was raised, this is a problem (or it hung and timed out)
            pytest.fail("Expected RuntimeError about loss scaling, but backward completed without error")

        model_engine.destroy()

    def test_scale_validates_scalar_loss(self, zero_stage):
        """Test that scale() validates the input is a scalar loss tensor"""
        hidden_dim = 4

        model_engine = create_deepspeed_engine(model_class=SimpleNonScalarModel,
                                               zero_stage=zero_stage,
                                               seed=42,
                                               hidden_dim=hidden_dim)

        device = get_accelerator().current_device_name()
        dtype = preferred_dtype()
        torch.manual_seed(123)
        x = torch.randn(2, hidden_dim, device=device, dtype=dtype)

        # Forward to get non-scalar output
        output = model_engine(x)

        # Trying to scale a non-scalar tensor should raise an assertion error
        with pytest.raises(AssertionError, match="scalar tensor"):
            model_engine.scale(output)

        model_engine.destroy()

    def test_scale_with_torch_autocast(self, zero_stage):
        """Test that scale() works correctly with torch.autocast and fp16"""
        if not get_accelerator().is_fp16_supported():
            pytest.skip("FP16 not supported on this accelerator")

        hidden_dim = 4

        # Initialize distributed first
        device, _, _ = initialize_distributed()

        # Create engine with fp16 config to test gradient scaling
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1,
            "zero_optimization": {
                "stage": zero_stage,
            },
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-3
                }
            },
            # Enable fp16 to test gradient scaling (bf16 doesn't use gradient scaling)
            "fp16": {
                "enabled": True,
                "initial_scale_power": 8
            }
        }

        if zero_stage == 3:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0

        model_engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        # Create data with fp16 dtype to match the config
        data_loader = random_dataloader(model=model_engine,
                                        total_samples=8,
                                        hidden_dim=hidden_dim,
                                        device=device,
                                        dtype=torch.float16)
        batch = next(iter(data_loader))

        # Forward and use scale()
        loss = model_engine(batch[0], batch[1])
        scaled_loss = model_engine.scale(loss)

        # Should be able to call backward
        scaled_loss.backward()

        # Collect gradients to verify they exist
        grads = collect_gradients_safe(model_engine)
        assert len(grads) > 0, "Expected gradients to be computed"

        model_engine.destroy()


class NonCheckpointedModel(torch.nn.Module):
    """Model without gradient checkpointing, used as reference for comparison."""

    def __init__(self, hidden_dim):
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x):
        x = self.linear1(x)
        x = torch.nn.functional.relu(x)
        x = self.linear2(x)
        return x


class CheckpointedModel(torch.nn.Module):
    """Model that uses gradient checkpointing with configurable use_reentrant setting.

    This model is designed to test the interaction between ZeRO-3 and gradient
    checkpointing with both reentrant (use_reentrant=True) and non-reentrant
    (use_reentrant=False) modes.

    Uses 2 layers to minimize numerical divergence from bfloat16 precision
    accumulation over multiple optimizer steps.
    """

    def __init__(self, hidden_dim, use_reentrant=True):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.linear1 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)

    def _checkpointed_block(self, x):
        """Block that will be checkpointed"""
        x = self.linear1(x)
        x = torch.nn.functional.relu(x)
        return x

    def forward(self, x):
        # Use gradient checkpointing on the first block
        if self.training:
            from torch.utils.checkpoint import checkpoint
            x = checkpoint(self._checkpointed_block, x, use_reentrant=self.use_reentrant)
        else:
            x = self._checkpointed_block(x)
        x = self.linear2(x)
        return x


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("use_reentrant", [True, False])
class TestZeroUserBackwardWithCheckpointing(DistributedTest):
    """Test ZeRO with gradient checkpointing and non-scalar backward.

    This test class validates the interaction between:
    1. ZeRO parameter partitioning (stages 1 and 3)
    2. Gradient checkpointing (both reentrant and non-reentrant modes)
    3. Non-scalar backward (tensor.backward(gradient=...))

    Both use_reentrant=True and use_reentrant=False are supported with ZeRO.
    Note: When using use_reentrant=True, input tensors should have requires_grad=True
    for proper gradient computation through the checkpointed region.
    """
    world_size = 2

    def test_checkpointed_non_scalar_backward(self, zero_stage, use_reentrant):
        """Test that gradient checkpointing works with ZeRO and non-scalar backward.

        Verifies that tensor.backward(gradient=...) works correctly with ZeRO
        and gradient checkpointing in both reentrant and non-reentrant modes.
        """
        hidden_dim = 8
        batch_size = 2

        # Initialize distributed environment
        device, rank, dtype = initialize_distributed()

        # Create DDP model for reference (no checkpointing issues with DDP)
        torch.manual_seed(42)
        model_ddp = CheckpointedModel(hidden_dim=hidden_dim, use_reentrant=use_reentrant)
        model_ddp = model_ddp.to(device=device, dtype=dtype)
        model_ddp = DDP(model_ddp, device_ids=[rank], output_device=rank)
        optimizer_ddp = torch.optim.Adam(model_ddp.parameters(), lr=1e-3)

        # Create DeepSpeed model with ZeRO-3
        torch.manual_seed(42)
        model_ds = CheckpointedModel(hidden_dim=hidden_dim, use_reentrant=use_reentrant)

        config = get_config_dict(zero_stage)
        model_engine, _, _, _ = deepspeed.initialize(config=config,
                                                     model=model_ds,
                                                     model_parameters=model_ds.parameters())

        # Create input data - use separate tensors for DDP and DeepSpeed to avoid
        # memory sharing issues during parallel test execution
        torch.manual_seed(123)
        x_ddp = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=True)

        # DDP: forward and non-scalar backward
        optimizer_ddp.zero_grad()
        output_ddp = model_ddp(x_ddp)
        grad_output = torch.ones_like(output_ddp)
        output_ddp.backward(grad_output)
        get_accelerator().synchronize()  # Ensure CUDA ops complete
        dist.barrier()  # Ensure all ranks complete gradient sync
        ddp_grads = collect_ddp_gradients(model_ddp)

        # DeepSpeed with ZeRO-3: forward and non-scalar backward
        # This is the pattern used in disaggregated training
        # Create fresh tensor with same seed for reproducibility
        torch.manual_seed(123)
        x_ds = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=True)
        output_ds = model_engine(x_ds)
        grad_output_ds = torch.ones_like(output_ds)

        # Non-scalar backward with gradient checkpointing
        output_ds.backward(grad_output_ds)

        # Synchronize device before collecting gradients. ZeRO-3 uses async operations
        # on separate streams for gradient reduction. With use_reentrant=True checkpointing,
        # we need to ensure all operations complete before reading gradient data.
        get_accelerator().synchronize()
        dist.barrier()  # Ensure all ranks complete backward before collecting gradients

        # Collect and verify gradients
        ds_grads = collect_gradients_safe(model_engine)

        # Verify gradients were computed
        assert len(ds_grads) > 0, \
            f"No gradients computed with use_reentrant={use_reentrant} and ZeRO-3"

        # Compare gradients with DDP reference
        compare_gradients(ddp_grads, ds_grads, f"with checkpointing use_reentrant={use_reentrant}")

        # Run optimizer step to verify full training loop works
        model_engine.step()

        model_engine.destroy()

    def test_checkpointed_scalar_backward(self, zero_stage, use_reentrant):
        """Test that gradient checkpointing works with ZeRO and scalar backward.

        Verifies that scalar loss.backward() works correctly with ZeRO and
        gradient checkpointing in both reentrant and non-reentrant modes.
        """
        hidden_dim = 8
        batch_size = 2

        # Initialize distributed environment
        device, rank, dtype = initialize_distributed()

        # Create DDP model for reference
        torch.manual_seed(42)
        model_ddp = CheckpointedModel(hidden_dim=hidden_dim, use_reentrant=use_reentrant)
        model_ddp = model_ddp.to(device=device, dtype=dtype)
        model_ddp = DDP(model_ddp, device_ids=[rank], output_device=rank)
        optimizer_ddp = torch.optim.Adam(model_ddp.parameters(), lr=1e-3)

        # Create DeepSpeed model with ZeRO-3
        torch.manual_seed(42)
        model_ds = CheckpointedModel(hidden_dim=hidden_dim, use_reentrant=use_reentrant)

        config = get_config_dict(zero_stage)
        model_engine, _, _, _ = deepspeed.initialize(config=config,
                                                     model=model_ds,
                                                     model_parameters=model_ds.parameters())

        # Create input data - use separate tensors for DDP and DeepSpeed to avoid
        # memory sharing issues during parallel test execution
        torch.manual_seed(123)
        x_ddp = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=True)
        y = torch.randint(0, hidden_dim, (batch_size, ), device=device)

        # DDP: forward with scalar loss and backward
        optimizer_ddp.zero_grad()
        output_ddp = model_ddp(x_ddp)
        loss_ddp = torch.nn.functional.cross_entropy(output_ddp, y)
        loss_ddp.backward()
        get_accelerator().synchronize()  # Ensure CUDA ops complete
        dist.barrier()  # Ensure all ranks complete gradient sync
        ddp_grads = collect_ddp_gradients(model_ddp)

        # DeepSpeed with ZeRO-3: forward with scalar loss and backward
        # Create fresh tensor with same seed for reproducibility
        torch.manual_seed(123)
        x_ds = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=True)
        output_ds = model_engine(x_ds)
        loss_ds = torch.nn.functional.cross_entropy(output_ds, y)

        loss_ds.backward()

        # Synchronize device before collecting gradients. ZeRO-3 uses async operations
        # on separate streams for gradient reduction. With use_reentrant=True checkpointing,
        # we need to ensure all operations complete before reading gradient data.
        get_accelerator().synchronize()
        dist.barrier()  # Ensure all ranks complete backward before collecting gradients

        # Collect and verify gradients
        ds_grads = collect_gradients_safe(model_engine)

        # Verify gradients were computed
        assert len(ds_grads) > 0, \
            f"No gradients computed with scalar loss, use_reentrant={use_reentrant}"

        # Compare gradients with DDP reference
        compare_gradients(ddp_grads, ds_grads, f"scalar loss with checkpointing use_reentrant={use_reentrant}")

        model_engine.destroy()

    def test_checkpointed_multiple_backward(self, zero_stage, use_reentrant):
        """Test multiple backward passes with checkpointing and ZeRO.

        Verifies that consecutive training iterations work correctly with
        gradient checkpointing. Compares gradients with DDP at all iterations
        to verify correctness. Uses PyTorch Adam for both to ensure fair comparison.
        """
        hidden_dim = 8
        batch_size = 2
        num_iterations = 3

        # Initialize distributed environment
        device, rank, dtype = initialize_distributed()

        # Create DDP model for reference with PyTorch Adam
        torch.manual_seed(42)
        model_ddp = CheckpointedModel(hidden_dim=hidden_dim, use_reentrant=use_reentrant)
        model_ddp = model_ddp.to(device=device, dtype=dtype)
        model_ddp = DDP(model_ddp, device_ids=[rank], output_device=rank)
        optimizer_ddp = torch.optim.Adam(model_ddp.parameters(), lr=1e-3)

        # Create DeepSpeed model WITH checkpointing, using PyTorch Adam
        torch.manual_seed(42)
        model_ds = CheckpointedModel(hidden_dim=hidden_dim, use_reentrant=use_reentrant)
        optimizer_ds = torch.optim.Adam(model_ds.parameters(), lr=1e-3)
        config = get_config_dict(zero_stage)
        model_engine, _, _, _ = deepspeed.initialize(config=config,
                                                     model=model_ds,
                                                     model_parameters=model_ds.parameters(),
                                                     optimizer=optimizer_ds)

        for iteration in range(num_iterations):
            # Use same random seed for both models
            torch.manual_seed(123 + iteration)
            x = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=True)

            # DDP: forward and backward
            optimizer_ddp.zero_grad()
            x_ddp = x.clone().detach().requires_grad_(True)
            output_ddp = model_ddp(x_ddp)
            output_ddp.backward(torch.ones_like(output_ddp))
            get_accelerator().synchronize()
            dist.barrier()
            ddp_grads = collect_ddp_gradients(model_ddp)

            # DeepSpeed: forward and backward
            x_ds = x.clone().detach().requires_grad_(True)
            output_ds = model_engine(x_ds)
            output_ds.backward(torch.ones_like(output_ds))
            get_accelerator().synchronize()
            dist.barrier()
            ds_grads = collect_gradients_safe(model_engine)

            # Verify gradients were computed
            assert len(ds_grads) > 0, \
                f"No gradients at iteration {iteration} with use_reentrant={use_reentrant}"

            # Compare gradients with DDP - using same optimizer so should match closely
            # Small differences at later iterations are expected due to bfloat16 precision
            compare_gradients(ddp_grads, ds_grads, f"iteration {iteration} with use_reentrant={use_reentrant}")

            # Run optimizer steps on both models
            optimizer_ddp.step()
            model_engine.step()

        model_engine.destroy()


class FrozenParamCheckpointedModel(torch.nn.Module):
    """Checkpointed model with a frozen parameter inside the checkpointed block.

    Mirrors the common PEFT / quantized setup where the base is frozen and only a small
    adapter trains. Under ZeRO-3 the frozen parameter is partitioned, and with non-reentrant
    checkpointing it used to be re-partitioned to shape [0] during the recompute, tripping
    torch's checkpoint metadata validation. See #4332.
    """

    def __init__(self, hidden_dim, use_reentrant=False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.norm = torch.nn.LayerNorm(hidden_dim)
        self.linear1 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)
        # Freeze the norm: this is the parameter that tripped the recompute metadata check.
        self.norm.weight.requires_grad_(False)
        self.norm.bias.requires_grad_(False)

    def _checkpointed_block(self, x):
        x = self.norm(x)
        x = self.linear1(x)
        x = torch.nn.functional.relu(x)
        return x

    def forward(self, x):
        if self.training:
            from torch.utils.checkpoint import checkpoint
            x = checkpoint(self._checkpointed_block, x, use_reentrant=self.use_reentrant)
        else:
            x = self._checkpointed_block(x)
        x = self.linear2(x)
        return x


@pytest.mark.parametrize("param_persistence_threshold", [0, _FROZEN_HIDDEN_DIM], ids=["nopersist", "persist"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("use_reentrant", [True, False])
class TestZeroUserBackwardFrozenParamCheckpointing(DistributedTest):
    """Regression test for ZeRO + gradient checkpointing with a frozen parameter.

    A frozen (non-grad) parameter inside a checkpointed block used to be partitioned to
    shape [0] during the non-reentrant recompute under ZeRO-3, tripping torch's checkpoint
    metadata validation with a CheckpointError. This verifies training runs and matches a
    PyTorch DDP reference (fp32 reproduces the error; bf16 covers mixed precision). See #4332.
    """
    world_size = 2

    def test_checkpointed_frozen_param(self, zero_stage, use_reentrant, dtype, param_persistence_threshold):
        run_frozen_checkpoint_comparison(FrozenParamCheckpointedModel,
                                         zero_stage,
                                         use_reentrant,
                                         dtype=dtype,
                                         param_persistence_threshold=param_persistence_threshold)


class MultiBlockFrozenModel(torch.nn.Module):
    """Several checkpointed blocks, each with its own frozen norm.

    Mirrors the diffusers UNet / stacked-transformer shape from #4332 and the extended MRE in
    #8130: the recompute re-fires the forward hooks of every block, so a release-lifetime bug
    compounds across blocks and modules must be released in the right (LIFO) order.
    """

    def __init__(self, hidden_dim, num_blocks=2, use_reentrant=False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = torch.nn.ModuleList()
        for _ in range(num_blocks):
            norm = torch.nn.LayerNorm(hidden_dim)
            norm.weight.requires_grad_(False)
            norm.bias.requires_grad_(False)
            block = torch.nn.ModuleDict({"norm": norm, "linear": torch.nn.Linear(hidden_dim, hidden_dim)})
            self.blocks.append(block)

    def _block_forward(self, block, x):
        x = block["norm"](x)
        x = block["linear"](x)
        return torch.nn.functional.relu(x)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            if self.training:
                x = checkpoint(self._block_forward, block, x, use_reentrant=self.use_reentrant)
            else:
                x = self._block_forward(block, x)
        return x


class LoRAStyleFrozenModel(torch.nn.Module):
    """LoRA-shaped model: a frozen base Linear plus a small trainable low-rank adapter.

    This is the PEFT/QLoRA configuration from transformers#47254 and trl#5217 reduced to its
    essential shape: the frozen base weight is the parameter that recomputed to shape [0].
    """

    def __init__(self, hidden_dim, rank=2, use_reentrant=False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.base = torch.nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = torch.nn.Linear(hidden_dim, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, hidden_dim, bias=False)
        self.head = torch.nn.Linear(hidden_dim, hidden_dim)

    def _checkpointed_block(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))

    def forward(self, x):
        if self.training:
            from torch.utils.checkpoint import checkpoint
            x = checkpoint(self._checkpointed_block, x, use_reentrant=self.use_reentrant)
        else:
            x = self._checkpointed_block(x)
        return self.head(x)


class MultiTensorLeafBlock(torch.nn.Module):
    """Leaf block with a frozen norm that returns multiple tensors.

    When marked as a ZeRO-3 leaf, autograd fires this module's pre-backward hooks from
    multiple threads (one per returned tensor), exercising the concurrent fetch_sub_module
    path that PR #8148's review flagged for duplicate backward-stack entries.
    """

    def __init__(self, hidden_dim):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_dim)
        self.norm.weight.requires_grad_(False)
        self.norm.bias.requires_grad_(False)
        self.linear_a = torch.nn.Linear(hidden_dim, hidden_dim)
        self.linear_b = torch.nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x):
        h = self.norm(x)
        return self.linear_a(h), self.linear_b(h)


class MultiTensorLeafFrozenModel(torch.nn.Module):
    """Model whose checkpointed region contains a multi-tensor-returning frozen leaf block."""

    def __init__(self, hidden_dim, use_reentrant=False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.block = MultiTensorLeafBlock(hidden_dim)
        self.head = torch.nn.Linear(hidden_dim, hidden_dim)

    def _checkpointed_block(self, x):
        a, b = self.block(x)
        return a + b

    def forward(self, x):
        if self.training:
            from torch.utils.checkpoint import checkpoint
            x = checkpoint(self._checkpointed_block, x, use_reentrant=self.use_reentrant)
        else:
            x = self._checkpointed_block(x)
        return self.head(x)


@pytest.mark.parametrize("param_persistence_threshold", [0, _FROZEN_HIDDEN_DIM], ids=["nopersist", "persist"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("use_reentrant", [True, False])
class TestZeroFrozenParamCheckpointingVariants(DistributedTest):
    """Additional frozen-param + activation-checkpoint repros distilled from the issues
    linked in PR #8130 (multi-block unet-style #4332, and PEFT/LoRA transformers#47254 /
    trl#5217). fp32 reproduces the original error; bf16 covers the common mixed-precision case.
    persist keeps the frozen norm weights resident (HF#47254 shape); nopersist partitions them."""
    world_size = 2

    def test_multi_block(self, zero_stage, use_reentrant, dtype, param_persistence_threshold):
        run_frozen_checkpoint_comparison(MultiBlockFrozenModel,
                                         zero_stage,
                                         use_reentrant,
                                         num_blocks=3,
                                         dtype=dtype,
                                         param_persistence_threshold=param_persistence_threshold)

    def test_lora_style(self, zero_stage, use_reentrant, dtype, param_persistence_threshold):
        run_frozen_checkpoint_comparison(LoRAStyleFrozenModel,
                                         zero_stage,
                                         use_reentrant,
                                         dtype=dtype,
                                         param_persistence_threshold=param_persistence_threshold)


@pytest.mark.parametrize("param_persistence_threshold", [0, _FROZEN_HIDDEN_DIM], ids=["nopersist", "persist"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestZeroFrozenParamMultiTensorLeaf(DistributedTest):
    """Leaf module returning multiple tensors -- the multi-threaded-autograd path called out in
    the #8148 review. Its backward hooks fire out of reverse-forward order; keying the
    coordinator's active-backward tracker by ds_id (instead of a strict LIFO deque) lets each
    submodule release regardless of position, so all stages pass."""
    world_size = 2

    def test_multi_tensor_leaf(self, zero_stage, use_reentrant, dtype, param_persistence_threshold):
        run_frozen_checkpoint_comparison(MultiTensorLeafFrozenModel,
                                         zero_stage,
                                         use_reentrant,
                                         leaf_module_types=[MultiTensorLeafBlock],
                                         dtype=dtype,
                                         param_persistence_threshold=param_persistence_threshold)


@pytest.mark.parametrize("param_persistence_threshold", [0, _FROZEN_HIDDEN_DIM], ids=["nopersist", "persist"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_reentrant", [True, False])
class TestZeroFrozenParamNoGradInputAccumulation(DistributedTest):
    """Frozen-param checkpointing with a no-grad input across grad-accumulation microbatches.

    tohtana's case in PR #8130: a no-grad input can leave the module post-backward hook unfired,
    so frozen params linger AVAILABLE between microbatches. Verifies release after each backward.
    """
    world_size = 2

    def test_no_grad_input_accumulation(self, use_reentrant, dtype, param_persistence_threshold):
        zero_stage = 3
        hidden_dim = _FROZEN_HIDDEN_DIM
        batch_size = 2
        gradient_accumulation_steps = 2
        num_iterations = 2

        device, rank, _ = initialize_distributed()
        # fp32 reproduces the release-lifetime gap; bf16 covers the common mixed-precision case.
        if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
            pytest.skip("bf16 is not supported on this accelerator")

        torch.manual_seed(42)
        model_ds = FrozenParamCheckpointedModel(hidden_dim=hidden_dim, use_reentrant=use_reentrant)
        model_ds = model_ds.to(dtype=dtype)
        config = get_config_dict(zero_stage,
                                 gradient_accumulation_steps=gradient_accumulation_steps,
                                 force_fp32=(dtype == torch.float32),
                                 param_persistence_threshold=param_persistence_threshold)
        trainable_params = [p for p in model_ds.parameters() if p.requires_grad]
        model_engine, _, _, _ = deepspeed.initialize(config=config, model=model_ds, model_parameters=trainable_params)

        seed = 123
        for iteration in range(num_iterations):
            for micro in range(gradient_accumulation_steps):
                step_info = f"use_reentrant={use_reentrant}, iter {iteration}, micro {micro}"

                torch.manual_seed(seed)
                # No-grad input: this is the configuration that broke the release lifetime.
                x = torch.randn(batch_size, hidden_dim, device=device, dtype=dtype, requires_grad=False)
                loss = model_engine(x).sum()
                model_engine.backward(loss)
                get_accelerator().synchronize()
                dist.barrier()

                # Frozen params must be partitioned between microbatches, not carried gathered.
                assert_all_partitioned(model_engine, zero_stage, step_info)
                # Persistent params must stay resident; check once the trace is complete (after warmup).
                if iteration >= 1:
                    assert_persistent_resident(model_engine, zero_stage, step_info)

                model_engine.step()
                seed += 1

        model_engine.destroy()


def build_managed_gas_config(zero_stage, gradient_accumulation_steps, managed_gradient_accumulation):
    """fp32 config toggling managed_gradient_accumulation; micro-batch 1 so total_samples == micro-batch count."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_print": 1,
        "managed_gradient_accumulation": managed_gradient_accumulation,
        "zero_optimization": {
            "stage": zero_stage,
        },
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3
            }
        },
    }


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
class TestUnmanagedGradientAccumulation(DistributedTest):
    """managed_gradient_accumulation=False: the caller's step() is the accumulation boundary."""
    world_size = 2

    def test_step_always_applies_update(self, zero_stage):
        """Every step() applies an optimizer update regardless of gradient_accumulation_steps."""
        hidden_dim = 4
        gradient_accumulation_steps = 4

        device, _, _ = initialize_distributed()
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        config = build_managed_gas_config(zero_stage, gradient_accumulation_steps, managed_gradient_accumulation=False)
        engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        data_loader = random_dataloader(model=engine,
                                        total_samples=8,
                                        hidden_dim=hidden_dim,
                                        device=device,
                                        dtype=torch.float32)

        prev_global_steps = engine.global_steps
        for batch in data_loader:
            loss = engine(batch[0], batch[1])
            engine.backward(loss)
            engine.step()
            assert engine.was_step_applied(), "Every step() must apply an update in unmanaged mode"
            assert engine.global_steps == prev_global_steps + 1
            prev_global_steps = engine.global_steps

        engine.destroy()

    def test_managed_baseline_applies_only_on_boundary(self, zero_stage):
        """Default managed mode only applies an update on the accumulation boundary."""
        hidden_dim = 4
        gradient_accumulation_steps = 4

        device, _, _ = initialize_distributed()
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        config = build_managed_gas_config(zero_stage, gradient_accumulation_steps, managed_gradient_accumulation=True)
        engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())

        data_loader = random_dataloader(model=engine,
                                        total_samples=2 * gradient_accumulation_steps,
                                        hidden_dim=hidden_dim,
                                        device=device,
                                        dtype=torch.float32)

        applied = []
        for batch in data_loader:
            loss = engine(batch[0], batch[1])
            engine.backward(loss)
            engine.step()
            applied.append(engine.was_step_applied())

        # Only every GAS-th micro-step (the boundary) applies an update.
        assert applied == [False, False, False, True, False, False, False, True]

        engine.destroy()

    def test_unmanaged_matches_managed(self, zero_stage):
        """N backwards + one step() in unmanaged mode equals managed mode with GAS=N."""
        hidden_dim = 4
        gradient_accumulation_steps = 4
        num_cycles = 3

        device, _, _ = initialize_distributed()

        torch.manual_seed(42)
        model_managed = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        managed_engine, _, _, _ = deepspeed.initialize(config=build_managed_gas_config(
            zero_stage, gradient_accumulation_steps, managed_gradient_accumulation=True),
                                                       model=model_managed,
                                                       model_parameters=model_managed.parameters())

        torch.manual_seed(42)
        model_unmanaged = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        unmanaged_engine, _, _, _ = deepspeed.initialize(config=build_managed_gas_config(
            zero_stage, gradient_accumulation_steps, managed_gradient_accumulation=False),
                                                         model=model_unmanaged,
                                                         model_parameters=model_unmanaged.parameters())

        total_samples = num_cycles * gradient_accumulation_steps
        # Materialize the batches so both engines consume identical data.
        batches = list(
            random_dataloader(model=managed_engine,
                              total_samples=total_samples,
                              hidden_dim=hidden_dim,
                              device=device,
                              dtype=torch.float32))

        # Managed: symmetric forward/backward/step on every micro-batch.
        for batch in batches:
            loss = managed_engine(batch[0], batch[1])
            managed_engine.backward(loss)
            managed_engine.step()

        # Unmanaged: accumulate N backwards, then a single step() per cycle.
        for cycle in range(num_cycles):
            for micro in range(gradient_accumulation_steps):
                batch = batches[cycle * gradient_accumulation_steps + micro]
                loss = unmanaged_engine(batch[0], batch[1])
                unmanaged_engine.backward(loss)
            unmanaged_engine.step()

        managed_params = collect_deepspeed_parameters(managed_engine, zero_stage)
        unmanaged_params = collect_deepspeed_parameters(unmanaged_engine, zero_stage)
        compare_parameters(managed_params, unmanaged_params, "unmanaged vs managed gradient accumulation")

        managed_engine.destroy()
        unmanaged_engine.destroy()

    def test_unmanaged_varying_backward_count(self, zero_stage):
        """Varying backward() count per step matches a managed manual-boundary reference and tracks global_samples."""
        hidden_dim = 4
        gradient_accumulation_steps = 4  # config value; unmanaged boundary is caller-owned
        backward_counts = [2, 5, 3]  # micro-batches per step: differs per step and from GAS

        device, _, _ = initialize_distributed()

        torch.manual_seed(42)
        model_unmanaged = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        unmanaged_engine, _, _, _ = deepspeed.initialize(config=build_managed_gas_config(
            zero_stage, gradient_accumulation_steps, managed_gradient_accumulation=False),
                                                         model=model_unmanaged,
                                                         model_parameters=model_unmanaged.parameters())

        torch.manual_seed(42)
        model_managed = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        managed_engine, _, _, _ = deepspeed.initialize(config=build_managed_gas_config(
            zero_stage, gradient_accumulation_steps, managed_gradient_accumulation=True),
                                                       model=model_managed,
                                                       model_parameters=model_managed.parameters())

        total_samples = sum(backward_counts)
        batches = list(
            random_dataloader(model=unmanaged_engine,
                              total_samples=total_samples,
                              hidden_dim=hidden_dim,
                              device=device,
                              dtype=torch.float32))

        # Unmanaged: N backwards accumulate locally, one step() reduces + updates; global_samples advances by N micro-batches.
        samples_per_micro_batch = unmanaged_engine.train_batch_size() // unmanaged_engine.gradient_accumulation_steps()
        expected_samples = unmanaged_engine.global_samples
        idx = 0
        for n in backward_counts:
            for _ in range(n):
                loss = unmanaged_engine(batches[idx][0], batches[idx][1])
                unmanaged_engine.backward(loss / n, scale_wrt_gas=False)
                idx += 1
            unmanaged_engine.step()
            assert unmanaged_engine.was_step_applied(), "Every step() must apply an update in unmanaged mode"
            expected_samples += samples_per_micro_batch * n
            assert unmanaged_engine.global_samples == expected_samples, \
                f"global_samples {unmanaged_engine.global_samples} != expected {expected_samples} at n={n}"

        # Managed reference: reproduce the same variable boundary via set_gradient_accumulation_boundary.
        idx = 0
        for n in backward_counts:
            for micro in range(n):
                managed_engine.set_gradient_accumulation_boundary(micro == n - 1)
                loss = managed_engine(batches[idx][0], batches[idx][1])
                managed_engine.backward(loss / n, scale_wrt_gas=False)
                idx += 1
            managed_engine.step()

        unmanaged_params = collect_deepspeed_parameters(unmanaged_engine, zero_stage)
        managed_params = collect_deepspeed_parameters(managed_engine, zero_stage)
        compare_parameters(managed_params, unmanaged_params, "unmanaged varying-N vs managed manual boundary")

        unmanaged_engine.destroy()
        managed_engine.destroy()

    def test_set_gradient_accumulation_boundary_rejected(self, zero_stage):
        """set_gradient_accumulation_boundary() is unsupported in unmanaged mode (caller owns the boundary)."""
        hidden_dim = 4
        initialize_distributed()
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        config = build_managed_gas_config(zero_stage,
                                          gradient_accumulation_steps=4,
                                          managed_gradient_accumulation=False)
        engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
        with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary"):
            engine.set_gradient_accumulation_boundary(True)
        engine.destroy()


class TestUnmanagedGradientAccumulationValidation(DistributedTest):
    """Unmanaged mode accepts disabled offload template blocks (device=none)."""
    world_size = 1

    def test_unmanaged_accepts_disabled_offload_blocks(self):
        # A disabled offload block (device="none") is not offload, so init must succeed.
        hidden_dim = 4
        initialize_distributed()
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        config = build_managed_gas_config(3, gradient_accumulation_steps=1, managed_gradient_accumulation=False)
        config["zero_optimization"]["offload_param"] = {"device": "none"}
        config["zero_optimization"]["offload_optimizer"] = {"device": "none"}
        engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
        assert not engine.managed_gradient_accumulation()
        engine.destroy()


def _build_unmanaged_offload_config(zero_stage,
                                    gradient_accumulation_steps,
                                    managed,
                                    offload_param=False,
                                    offload_device="cpu",
                                    nvme_path=None):
    config = build_managed_gas_config(zero_stage, gradient_accumulation_steps, managed_gradient_accumulation=managed)
    offload_opt = {"device": offload_device}
    if offload_device == OffloadDeviceEnum.nvme:
        assert nvme_path is not None, "nvme_path is required for NVMe offload"
        offload_opt["nvme_path"] = str(nvme_path)
    config["zero_optimization"]["offload_optimizer"] = offload_opt
    if offload_param:
        offload_p = {"device": offload_device}
        if offload_device == OffloadDeviceEnum.nvme:
            offload_p["nvme_path"] = str(nvme_path)
        config["zero_optimization"]["offload_param"] = offload_p
    if offload_device == OffloadDeviceEnum.nvme:
        # Small sub_group_size so each large param is its own swappable subgroup.
        config["zero_optimization"]["sub_group_size"] = 100
        config["aio"] = {"block_size": 1048576}
    return config


def _run_unmanaged_vs_managed_offload(zero_stage,
                                      gradient_accumulation_steps,
                                      num_cycles,
                                      offload_param=False,
                                      offload_device="cpu",
                                      nvme_path=None,
                                      hidden_dim=4,
                                      label=""):
    device, _, _ = initialize_distributed()

    def make_config(managed):
        return _build_unmanaged_offload_config(zero_stage,
                                               gradient_accumulation_steps,
                                               managed=managed,
                                               offload_param=offload_param,
                                               offload_device=offload_device,
                                               nvme_path=nvme_path)

    torch.manual_seed(42)
    if zero_stage == 3 and offload_device == OffloadDeviceEnum.nvme:
        with deepspeed.zero.Init(config_dict_or_path=make_config(True)):
            model_managed = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
    else:
        model_managed = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
    managed_engine, _, _, _ = deepspeed.initialize(config=make_config(True),
                                                   model=model_managed,
                                                   model_parameters=model_managed.parameters())

    torch.manual_seed(42)
    if zero_stage == 3 and offload_device == OffloadDeviceEnum.nvme:
        with deepspeed.zero.Init(config_dict_or_path=make_config(False)):
            model_unmanaged = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
    else:
        model_unmanaged = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
    unmanaged_engine, _, _, _ = deepspeed.initialize(config=make_config(False),
                                                     model=model_unmanaged,
                                                     model_parameters=model_unmanaged.parameters())

    total_samples = num_cycles * gradient_accumulation_steps
    batches = list(
        random_dataloader(model=managed_engine,
                          total_samples=total_samples,
                          hidden_dim=hidden_dim,
                          device=device,
                          dtype=torch.float32))

    for batch in batches:
        loss = managed_engine(batch[0], batch[1])
        managed_engine.backward(loss)
        managed_engine.step()

    for cycle in range(num_cycles):
        for micro in range(gradient_accumulation_steps):
            batch = batches[cycle * gradient_accumulation_steps + micro]
            loss = unmanaged_engine(batch[0], batch[1])
            unmanaged_engine.backward(loss)
        unmanaged_engine.step()

    managed_params = collect_deepspeed_parameters(managed_engine, zero_stage)
    unmanaged_params = collect_deepspeed_parameters(unmanaged_engine, zero_stage)
    compare_parameters(managed_params, unmanaged_params, label)

    managed_engine.destroy()
    unmanaged_engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestUnmanagedGradientAccumulationOffload(DistributedTest):
    """Unmanaged mode with ZeRO optimizer offload matches managed offload."""
    world_size = 2

    def test_unmanaged_matches_managed_optimizer_offload(self, zero_stage):
        _run_unmanaged_vs_managed_offload(zero_stage,
                                          gradient_accumulation_steps=4,
                                          num_cycles=3,
                                          label=f"unmanaged vs managed optimizer offload (stage {zero_stage})")


class TestUnmanagedGradientAccumulationParamOffload(DistributedTest):
    """Unmanaged ZeRO-3 with parameter + optimizer offload matches managed mode."""
    world_size = 2

    def test_unmanaged_matches_managed_param_offload(self):
        _run_unmanaged_vs_managed_offload(zero_stage=3,
                                          gradient_accumulation_steps=4,
                                          num_cycles=2,
                                          offload_param=True,
                                          label="unmanaged vs managed param+optimizer offload (stage 3)")


@pytest.mark.sequential
class TestUnmanagedGradientAccumulationNvmeOffload(DistributedTest):
    """Unmanaged ZeRO-3 NVMe offload matches managed NVMe offload."""
    world_size = 2

    def _skip_if_nvme_unsupported(self):
        if not deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]:
            pytest.skip("Skip tests since async-io is not compatible")

    def test_unmanaged_matches_managed_optimizer_nvme_offload(self, tmpdir):
        self._skip_if_nvme_unsupported()
        # Large enough that partitioned params exceed MIN_AIO_BYTES and exercise swap_out_gradients.
        _run_unmanaged_vs_managed_offload(zero_stage=3,
                                          gradient_accumulation_steps=2,
                                          num_cycles=2,
                                          offload_device=OffloadDeviceEnum.nvme,
                                          nvme_path=tmpdir,
                                          hidden_dim=1024,
                                          label="unmanaged vs managed optimizer NVMe offload (stage 3)")

    def test_unmanaged_matches_managed_param_nvme_offload(self, tmpdir):
        self._skip_if_nvme_unsupported()
        _run_unmanaged_vs_managed_offload(zero_stage=3,
                                          gradient_accumulation_steps=2,
                                          num_cycles=2,
                                          offload_param=True,
                                          offload_device=OffloadDeviceEnum.nvme,
                                          nvme_path=tmpdir,
                                          hidden_dim=1024,
                                          label="unmanaged vs managed param+optimizer NVMe offload (stage 3)")


class _TwoHeadModel(torch.nn.Module):
    """Two independent heads; only one is exercised per window so the other receives no gradient."""

    def __init__(self, hidden_dim):
        super().__init__()
        self.head_a = torch.nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.head_b = torch.nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        self.use_a = True

    def forward(self, x, y):
        out = self.head_a(x) if self.use_a else self.head_b(x)
        return self.cross_entropy_loss(out, y)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestUnmanagedGradientAccumulationOffloadInactiveParams(DistributedTest):
    """Unmanaged optimizer offload must skip params that receive no gradient in a window (matches managed)."""
    world_size = 2

    def test_unmanaged_matches_managed_inactive_params(self, zero_stage):
        hidden_dim = 4
        gradient_accumulation_steps = 2
        # One head is exclusively active per window, so the other head is inactive that whole window.
        window_use_a = [True, False, True]

        device, _, _ = initialize_distributed()

        def offload_config(managed):
            config = _build_unmanaged_offload_config(zero_stage, gradient_accumulation_steps, managed=managed)
            config["zero_optimization"]["ignore_unused_parameters"] = True
            return config

        torch.manual_seed(123)
        model_managed = _TwoHeadModel(hidden_dim)
        managed_engine, _, _, _ = deepspeed.initialize(config=offload_config(True),
                                                       model=model_managed,
                                                       model_parameters=model_managed.parameters())

        torch.manual_seed(123)
        model_unmanaged = _TwoHeadModel(hidden_dim)
        unmanaged_engine, _, _, _ = deepspeed.initialize(config=offload_config(False),
                                                         model=model_unmanaged,
                                                         model_parameters=model_unmanaged.parameters())

        total_samples = len(window_use_a) * gradient_accumulation_steps
        batches = list(
            random_dataloader(model=managed_engine,
                              total_samples=total_samples,
                              hidden_dim=hidden_dim,
                              device=device,
                              dtype=torch.float32))

        # Managed: symmetric forward/backward/step; optimizer applies on each GAS boundary.
        for w, use_a in enumerate(window_use_a):
            managed_engine.module.use_a = use_a
            for micro in range(gradient_accumulation_steps):
                batch = batches[w * gradient_accumulation_steps + micro]
                loss = managed_engine(batch[0], batch[1])
                managed_engine.backward(loss)
                managed_engine.step()

        # Unmanaged: N backwards then one step() per window.
        for w, use_a in enumerate(window_use_a):
            unmanaged_engine.module.use_a = use_a
            for micro in range(gradient_accumulation_steps):
                batch = batches[w * gradient_accumulation_steps + micro]
                loss = unmanaged_engine(batch[0], batch[1])
                unmanaged_engine.backward(loss)
            unmanaged_engine.step()

        managed_params = collect_deepspeed_parameters(managed_engine, zero_stage)
        unmanaged_params = collect_deepspeed_parameters(unmanaged_engine, zero_stage)
        compare_parameters(managed_params, unmanaged_params,
                           f"unmanaged vs managed offload inactive params (stage {zero_stage})")

        managed_engine.destroy()
        unmanaged_engine.destroy()


@pytest.mark.parametrize("zero_stage", [0, 1])
class TestUnmanagedGradientAccumulationOverlapCommValidation(DistributedTest):
    """Unmanaged mode rejects ZeRO overlap_comm for stage 0/1 (reduction is deferred to step())."""
    world_size = 1

    def test_unmanaged_rejects_overlap_comm(self, zero_stage):
        hidden_dim = 4
        initialize_distributed()
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        config = build_managed_gas_config(zero_stage,
                                          gradient_accumulation_steps=1,
                                          managed_gradient_accumulation=False)
        config["zero_optimization"]["overlap_comm"] = True
        with pytest.raises(AssertionError, match="overlap_comm only with ZeRO stage 2"):
            deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())


class TestUnmanagedGradientAccumulationOverlapCommStage2(DistributedTest):
    """overlap_comm is supported in unmanaged mode for ZeRO stage 2 (reduction stays per-backward)."""
    world_size = 2

    def test_unmanaged_matches_managed_overlap_comm(self):
        hidden_dim = 4
        gradient_accumulation_steps = 4
        num_cycles = 3

        device, _, _ = initialize_distributed()

        def overlap_config(managed):
            config = build_managed_gas_config(2, gradient_accumulation_steps, managed_gradient_accumulation=managed)
            config["zero_optimization"]["overlap_comm"] = True
            config["zero_optimization"]["contiguous_gradients"] = True
            return config

        torch.manual_seed(42)
        model_managed = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        managed_engine, _, _, _ = deepspeed.initialize(config=overlap_config(True),
                                                       model=model_managed,
                                                       model_parameters=model_managed.parameters())

        torch.manual_seed(42)
        model_unmanaged = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        unmanaged_engine, _, _, _ = deepspeed.initialize(config=overlap_config(False),
                                                         model=model_unmanaged,
                                                         model_parameters=model_unmanaged.parameters())

        total_samples = num_cycles * gradient_accumulation_steps
        batches = list(
            random_dataloader(model=managed_engine,
                              total_samples=total_samples,
                              hidden_dim=hidden_dim,
                              device=device,
                              dtype=torch.float32))

        for batch in batches:
            loss = managed_engine(batch[0], batch[1])
            managed_engine.backward(loss)
            managed_engine.step()

        for cycle in range(num_cycles):
            for micro in range(gradient_accumulation_steps):
                batch = batches[cycle * gradient_accumulation_steps + micro]
                loss = unmanaged_engine(batch[0], batch[1])
                unmanaged_engine.backward(loss)
            unmanaged_engine.step()

        managed_params = collect_deepspeed_parameters(managed_engine, 2)
        unmanaged_params = collect_deepspeed_parameters(unmanaged_engine, 2)
        compare_parameters(managed_params, unmanaged_params, "unmanaged vs managed with overlap_comm (stage 2)")

        managed_engine.destroy()
        unmanaged_engine.destroy()


@pytest.mark.parametrize("zero_stage", [1, 2])
class TestUnmanagedGradientAccumulationCoalesceValidation(DistributedTest):
    """coalesce_grad_reduction() conflicts with unmanaged mode: both own the accumulation boundary."""
    world_size = 1

    def test_unmanaged_rejects_coalesce_grad_reduction(self, zero_stage):
        hidden_dim = 4
        initialize_distributed()
        torch.manual_seed(42)
        model = SimpleModel(hidden_dim=hidden_dim, nlayers=2)
        config = build_managed_gas_config(zero_stage,
                                          gradient_accumulation_steps=1,
                                          managed_gradient_accumulation=False)
        engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
        with pytest.raises(AssertionError, match="coalesce_grad_reduction"):
            with engine.coalesce_grad_reduction():
                pass
        engine.destroy()


class TestUnmanagedGradientAccumulationPipelineValidation(DistributedTest):
    """Unmanaged mode is incompatible with pipeline parallelism."""
    world_size = 2

    def test_unmanaged_rejects_pipeline(self):
        from deepspeed.runtime.pipe.module import PipelineModule

        initialize_distributed()
        layers = [torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)]
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
        config = build_managed_gas_config(0, gradient_accumulation_steps=1, managed_gradient_accumulation=False)
        with pytest.raises(AssertionError, match="not supported with pipeline parallelism"):
            deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
