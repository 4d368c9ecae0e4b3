"""Every way of writing a factory trains to the reference: the job's code travels with it
(`elastic.shipping`) whether it is a partial, a class, a bound method, a callable instance,
a lambda or closure in a script run as `__main__`, or a file the workers cannot import."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import default_collate

import elastic
from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
from tests.jobs import make_dataset, make_model, make_optimizer, mse

pytestmark = pytest.mark.integration

B, STEPS = 16, 3


def _fit(job: TrainJob, tmp_path: pathlib.Path) -> dict[str, torch.Tensor]:
    config = FitConfig(scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=B),
                       max_steps=STEPS, run_dir=str(tmp_path / "run"))
    result = elastic.fit(job, config)
    assert result.steps == STEPS
    return result.model_state


def _reference(lr: float = 0.05, momentum: float = 0.9) -> dict[str, torch.Tensor]:
    """The regression job with SGD(lr, momentum) in one process, the public sample order;
    written without project code."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    x, y = make_dataset().tensors
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        idx = perm[step * B:(step + 1) * B]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return model.state_dict()


def _assert_reference(state: dict[str, torch.Tensor], lr: float = 0.05, momentum: float = 0.9) -> None:
    # Compared by position: a model written as a class names its parameters differently.
    expected = _reference(lr, momentum)
    torch.testing.assert_close(list(state.values()), list(expected.values()), rtol=1e-9, atol=1e-10)


class Net(torch.nn.Module):
    """The regression model written as a class: the class itself is the factory."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Trainer:
    """A user object whose bound method is the loss, and which is itself callable."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def loss(self, model, batch) -> torch.Tensor:
        return self.scale * mse(model, batch)

    def __call__(self, model, batch) -> torch.Tensor:
        return self.loss(model, batch)


def sgd(params, lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def test_a_partial_of_a_torch_optimizer(ray_cluster, tmp_path):
    job = TrainJob(model=make_model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                   loss=mse, dataset=make_dataset)
    _assert_reference(_fit(job, tmp_path), lr=0.1, momentum=0.0)


def test_a_partial_of_a_user_function(ray_cluster, tmp_path):
    job = TrainJob(model=make_model, optimizer=functools.partial(sgd, lr=0.05, momentum=0.9),
                   loss=mse, dataset=make_dataset)
    _assert_reference(_fit(job, tmp_path))


def test_a_plain_class(ray_cluster, tmp_path):
    job = TrainJob(model=Net, optimizer=make_optimizer, loss=mse, dataset=make_dataset)
    _assert_reference(_fit(job, tmp_path))


def test_a_bound_method(ray_cluster, tmp_path):
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=Trainer(1.0).loss, dataset=make_dataset)
    _assert_reference(_fit(job, tmp_path))


def test_a_callable_instance(ray_cluster, tmp_path):
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=Trainer(1.0), dataset=make_dataset)
    _assert_reference(_fit(job, tmp_path))


def test_a_function_of_an_installed_package(ray_cluster, tmp_path):
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset,
                   collate_fn=default_collate)
    _assert_reference(_fit(job, tmp_path))


def test_a_user_file_the_workers_cannot_import(ray_cluster, tmp_path):
    # The target imports a helper module beside it: both travel by value, the helper found
    # through the globals the target's functions use.
    code = tmp_path / "code"
    code.mkdir()
    (code / "shipped_helpers.py").write_text(textwrap.dedent("""
        import torch
        def optimizer(params):
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    """))
    (code / "shipped_job.py").write_text(textwrap.dedent("""
        import elastic
        import shipped_helpers
        from tests.jobs import make_dataset, make_model, mse
        def build():
            return elastic.TrainJob(model=make_model, optimizer=lambda p: shipped_helpers.optimizer(p),
                                    loss=mse, dataset=make_dataset)
    """))
    job = elastic.load_target(f"{code / 'shipped_job.py'}:build")
    _assert_reference(_fit(job, tmp_path))


SCRIPT = """
import functools, sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import elastic

class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    def forward(self, x):
        return self.body(x)

def data_factory(seed):
    def make():  # a closure over `seed`
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(96, 6, generator=g, dtype=torch.float64)
        w = torch.randn(6, 1, generator=g, dtype=torch.float64)
        return TensorDataset(x, x @ w + 0.1 * torch.randn(96, 1, generator=g, dtype=torch.float64))
    return make

if __name__ == "__main__":
    job = elastic.TrainJob(model=Regressor, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           loss=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
                           dataset=data_factory(1234))
    config = elastic.FitConfig(scaling=elastic.ScalingConfig(num_workers=2), max_steps=3,
                               batch=elastic.BatchConfig(global_batch_size=16), run_dir=sys.argv[2])
    torch.save(elastic.fit(job, config).model_state, sys.argv[1])
"""


def test_a_class_partial_lambda_and_closure_in_a_script_run_as_main(ray_cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "state.pt"
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    # Run from tmp_path: neither the script nor this repository is importable there.
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, str(script), str(out), str(tmp_path / "run")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_reference(torch.load(out, weights_only=True), lr=0.1, momentum=0.0)
    # The same script's factories written as plain functions give the same weights.
    plain = TrainJob(model=make_model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=mse,
                     dataset=make_dataset)
    torch.testing.assert_close(list(torch.load(out, weights_only=True).values()),
                               list(_fit(plain, tmp_path / "plain").values()), rtol=1e-9, atol=1e-10)

