"""The Lightning adapter without Ray: what `lightning_job` reads from a module and its Trainer
arguments, what it refuses (each with its message), and its factories in one process."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

from elastic import BatchConfig, FitConfig, ScalingConfig, TrainingConfig
from elastic.config import with_job_settings
from elastic.errors import ConfigError
from elastic.trainer.training import Training

L = pytest.importorskip("lightning.pytorch")

from elastic.integrations.lightning import REFUSED_HOOKS, EveryN, _parse_optimizers, lightning_job  # noqa: E402
from tests.lightning_modules import Data, Regressor  # noqa: E402


def _sgd():
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


# --- configure_optimizers, every documented form ----------------------------------------------


def test_every_documented_configure_optimizers_form_gives_one_optimizer_and_its_scheduler():
    opt = _sgd()
    step = torch.optim.lr_scheduler.StepLR(opt, 2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert _parse_optimizers(opt) == (opt, None)
    assert _parse_optimizers([opt]) == (opt, None)
    assert _parse_optimizers(([opt], [step])) == (opt, {"scheduler": step})
    assert _parse_optimizers({"optimizer": opt}) == (opt, None)
    assert _parse_optimizers({"optimizer": opt, "lr_scheduler": step}) == (opt, {"scheduler": step})
    assert _parse_optimizers([{"optimizer": opt, "lr_scheduler": {"scheduler": step, "frequency": 3}}]) \
        == (opt, {"scheduler": step, "frequency": 3})
    assert _parse_optimizers({"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"}) \
        == (opt, {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch"})


@pytest.mark.parametrize(("conf", "message"), [
    (lambda o: [o, _sgd()], "2 optimizers"),
    (lambda o: ([o], [torch.optim.lr_scheduler.StepLR(o, 1), torch.optim.lr_scheduler.StepLR(o, 2)]),
     "2 schedulers"),
    (lambda o: [{"optimizer": o}, {"optimizer": _sgd()}], "2 optimizer dicts"),
    (lambda o: None, "returned NoneType"),
    (lambda o: {"optimizer": o, "lr_scheduler": {"interval": "step"}}, "needs the key 'scheduler'"),
])
def test_what_elastic_cannot_train_is_refused_by_name(conf, message):
    with pytest.raises(ConfigError, match=message):
        _parse_optimizers(conf(_sgd()))


# --- the module's hooks and the Trainer's arguments ---------------------------------------------


class _Manual(Regressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _BatchEnd(Regressor):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


class _AsksTrainer(Regressor):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr / self.trainer.max_epochs)


class _NotLightning:
    pass


class _TrainOnlyPlateau(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                "monitor": "train_loss"}


class _ConfiguredLater(Regressor):
    """Builds its layers in configure_model, as Lightning recommends for large models."""

    def __init__(self):
        super().__init__()
        del self.net

    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


@pytest.mark.parametrize(("module", "kwargs", "message"), [
    (_Manual, {}, "automatic_optimization = False"),
    (_BatchEnd, {}, r"_BatchEnd.on_train_batch_end: .*elastic.Callback"),
    (_AsksTrainer, {}, "reads self.trainer"),
    (_NotLightning, {}, "not a LightningModule"),
    (Regressor, {"accumulate_grad_batches": 4}, "global_batch_size to the batch size times 4"),
    (_TrainOnlyPlateau, {}, "'train_loss', which training_step does not log with that name"),
    (Regressor, {"precision": "64-true"}, "precision='64-true'"),
    (Regressor, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "l1"}, "'norm' or 'value'"),
])
def test_a_hook_or_argument_with_no_elastic_meaning_is_refused_with_what_to_do(module, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        lightning_job(module, Data, **kwargs)


@pytest.mark.parametrize("hook", [*REFUSED_HOOKS, "on_before_batch_transfer",
                                  "transfer_batch_to_device", "on_after_batch_transfer"])
def test_every_refused_hook_is_named_with_what_to_do_instead(hook):
    module = type(f"With_{hook}", (Regressor,), {hook: lambda self, *a, **k: None})
    with pytest.raises(ConfigError, match=rf"With_{hook}\.{hook}: elastic does not run "
                                          rf"LightningModule hook {hook} .*: \w"):
        lightning_job(module, Data)


def test_a_data_module_batch_transfer_hook_is_refused_where_the_data_is_built():
    data = type("Moving", (Data,), {"transfer_batch_to_device": lambda self, *a: None})
    job = lightning_job(Regressor, data)
    with pytest.raises(ConfigError, match=r"Moving.transfer_batch_to_device: .* TrainJob.move_batch"):
        job.dataset()


def test_an_instance_is_refused_for_every_worker_builds_its_own():
    with pytest.raises(ConfigError, match="must be a LightningModule class or a function"):
        lightning_job(Regressor(), Data)
    with pytest.raises(ConfigError, match="must be a LightningDataModule class or a function"):
        lightning_job(Regressor, Data())


def test_a_module_that_builds_its_layers_in_configure_model_is_read_and_built():
    job = lightning_job(_ConfiguredLater, Data)
    model = job.model()
    assert sum(p.numel() for p in model.parameters()) == 4 * 8 + 8 + 8 + 1
    assert job.optimizer(model).param_groups[0]["params"]


def test_trainer_arguments_and_the_scheduler_become_the_jobs_settings():
    job = lightning_job(Regressor, Data, precision="16-mixed", gradient_clip_val=0.5,
                        gradient_clip_algorithm="value", max_epochs=3, check_val_every_n_epoch=2)
    assert job.settings == {"training.precision": "fp16-mixed", "training.clip_grad_value": 0.5,
                            "epochs": 3, "evaluation.every_epochs": 2}
    assert job.lr_scheduler is not None and job.eval_step is not None
    # A ReduceLROnPlateau on a validation metric steps after each evaluation, as Lightning's
    # steps after the epoch's validation.
    plateau = lightning_job(Regressor, Data, scheduler="plateau")
    assert plateau.settings == {"training.scheduler_interval": "evaluation",
                                "training.scheduler_monitor": "eval/val_loss"}
    assert lightning_job(Regressor, Data, scheduler="none").lr_scheduler is None


# --- the settings meet the run's configuration ------------------------------------------------


def _config(**training) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=8),
                     max_steps=4, **({"training": TrainingConfig(**training)} if training else {}))


def test_settings_fill_what_the_configuration_leaves_unset_and_refuse_a_contradiction():
    settings = {"training.precision": "bf16-mixed", "epochs": 2}
    merged = with_job_settings(_config(), settings, "the Lightning module")
    assert merged.training.precision == "bf16-mixed" and merged.epochs == 2
    assert merged.max_steps == 4 and merged.scaling.num_workers == 2
    same = with_job_settings(_config(precision="bf16-mixed"), settings, "the Lightning module")
    assert same.training.precision == "bf16-mixed"
    kept = with_job_settings(_config(clip_grad_norm=1.0), settings, "x")
    assert kept.training.clip_grad_norm == 1.0 and kept.training.precision == "bf16-mixed"
    with pytest.raises(ConfigError, match=r"implies training.precision='bf16-mixed', but the "
                                          r"configuration sets training.precision='32'"):
        with_job_settings(_config(precision="32"), settings, "the Lightning module")
    with pytest.raises(ConfigError, match=r"'training.nope', which is not a FitConfig field"):
        with_job_settings(_config(), {"training.nope": 1}, "x")


def test_for_job_builds_a_whole_configuration_from_the_jobs_settings():
    job = lightning_job(Regressor, Data, max_epochs=3, precision="bf16-mixed")
    config = FitConfig.for_job(job, scaling=ScalingConfig(num_workers=2),
                               batch=BatchConfig(global_batch_size=8),
                               training=TrainingConfig(clip_grad_norm=1.0))
    assert (config.epochs, config.training.precision, config.training.clip_grad_norm) == (
        3, "bf16-mixed", 1.0)
    with pytest.raises(ConfigError, match="implies epochs=3, but the configuration sets epochs=4"):
        FitConfig.for_job(job, scaling=ScalingConfig(num_workers=2),
                          batch=BatchConfig(global_batch_size=8), epochs=4)


# --- the factories in one process -----------------------------------------------------------


def test_the_factories_train_log_and_evaluate_as_the_module_says():
    job = lightning_job(Regressor, Data)
    torch.manual_seed(0)
    model = job.model()
    optimizer = job.optimizer(model)
    scheduler = job.lr_scheduler(optimizer)
    assert isinstance(scheduler, EveryN) and scheduler.n == 2  # the module's frequency
    data = job.dataset()
    batch = job.collate_fn([data[i] for i in range(5)])
    loss, metrics = job.loss(model, batch)
    x, y = batch
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(model.net(x), y))
    torch.testing.assert_close(metrics["train_mae"], (model.net(x) - y).abs().mean())
    terms = job.eval_step(model, batch)
    assert set(terms) == {"val_loss", "val_mae"} and terms["val_loss"][1] == 5.0
    with torch.no_grad():
        assert float(terms["val_loss"][0]) / 5 == pytest.approx(
            float(torch.nn.functional.mse_loss(model.net(x), y)), rel=1e-6)
    assert len(job.eval_dataset()) == 40


def test_every_n_steps_its_scheduler_every_nth_call_and_keeps_the_count_in_its_state():
    opt = _sgd()
    every = EveryN(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), 3)
    for _ in range(4):
        opt.step()
        every.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    state = every.state_dict()
    again = EveryN(torch.optim.lr_scheduler.StepLR(_sgd(), step_size=1, gamma=0.5), 3)
    again.load_state_dict(state)
    assert again.calls == 4


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


class _StreamData(Data):
    def train_dataloader(self):
        return DataLoader(_Stream())


def test_an_iterable_training_set_is_refused_when_the_data_is_built():
    job = lightning_job(Regressor, _StreamData)
    with pytest.raises(ConfigError, match="IterableDataset"):
        job.dataset()


# --- found by a review: differences from lightning.Trainer that went unsaid ---------------


class _HeadOnly(Regressor):
    """Trains its last layer only, the rest still requiring gradients."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[2].parameters(), lr=self.lr)


def test_clipping_with_an_optimizer_over_some_trainable_parameters_is_refused():
    # Lightning clips the optimizer's parameters; elastic clips every trainable one: the
    # norms (and the weights) would differ with no error.
    with pytest.raises(ConfigError, match="freeze the others"):
        lightning_job(_HeadOnly, Data, gradient_clip_val=0.5)
    lightning_job(_HeadOnly, Data)  # without clipping it trains the same

    class _Frozen(_HeadOnly):
        def __init__(self):
            super().__init__()
            for p in self.net[0].parameters():
                p.requires_grad_(False)

    assert lightning_job(_Frozen, Data, gradient_clip_val=0.5).settings[
        "training.clip_grad_norm"] == 0.5


def test_a_trainer_argument_elastic_does_not_take_is_refused_not_passed_to_the_module():
    with pytest.raises(ConfigError, match=r"val_check_interval: lightning.Trainer argument"):
        lightning_job(Regressor, Data, val_check_interval=0.5)
    assert lightning_job(Regressor, Data, hidden=4).settings == {}  # the module's own


class _BoundCollate(Data):
    def collate(self, samples):
        return torch.utils.data.default_collate(samples)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=4, collate_fn=self.collate)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=4, collate_fn=self.collate)


class _OtherCollate(_BoundCollate):
    def val_dataloader(self):
        return DataLoader(self.val, batch_size=4, collate_fn=lambda s: self.collate(s))


def test_one_bound_collate_method_read_by_both_loaders_is_the_same_collate_fn():
    # Each read of `self.collate` is a new bound-method object: before, compared by identity,
    # the two loaders were refused as having different collate functions.
    job = lightning_job(Regressor, _BoundCollate)
    assert len(job.dataset()) > 0 and len(job.eval_dataset()) > 0
    with pytest.raises(ConfigError, match="collate_fn differs"):
        lightning_job(Regressor, _OtherCollate).dataset()


# --- found by a review against lightning 2.6.6: what Lightning accepts and elastic refused ---


def _fit(module, datamodule, tmp_path, **trainer_kwargs):
    """`lightning.Trainer.fit` in this process, on the CPU, with nothing written."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), **trainer_kwargs)
    trainer.fit(module, datamodule)
    return trainer


class _Bare(L.LightningModule):
    """Steps that take no batch_idx; each call is recorded with how many arguments follow
    the batch."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.calls = []

    def training_step(self, batch):
        self.calls.append(("training_step", 0))
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch):
        self.calls.append(("validation_step", 0))
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Rest(_Bare):
    def training_step(self, batch, *rest):
        self.calls.append(("training_step", len(rest)))
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, *rest):
        self.calls.append(("validation_step", len(rest)))
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))


@pytest.mark.parametrize("module", [_Bare, _Rest])
def test_steps_get_batch_idx_only_when_they_take_it_as_lightning_calls_them(tmp_path, module):
    # Before, batch_idx was always passed: a step without it failed with a TypeError.
    lightning = module()
    _fit(lightning, Data(), tmp_path, fast_dev_run=1)  # one training and one validation batch
    job = lightning_job(module, Data)
    model = job.model()
    batch = job.collate_fn([job.dataset()[i] for i in range(4)])
    loss = job.loss(model, batch)
    torch.testing.assert_close(loss, F.mse_loss(model.net(batch[0]), batch[1]))
    assert set(job.eval_step(model, batch)) == {"val_loss"}
    assert model.calls == lightning.calls


def test_lightnings_own_trainer_defaults_are_taken_with_lightnings_meaning():
    import inspect

    # Every argument lightning_job takes, at lightning.Trainer's own default: nothing to set.
    defaults = {name: p.default for name, p in inspect.signature(L.Trainer).parameters.items()
                if name in ("precision", "gradient_clip_val", "gradient_clip_algorithm",
                            "accumulate_grad_batches", "max_epochs", "max_steps",
                            "check_val_every_n_epoch")}
    assert defaults["precision"] is None and defaults["gradient_clip_algorithm"] is None
    assert lightning_job(Regressor, Data, **defaults).settings == {}
    assert L.Trainer(precision=None, logger=False).precision == "32-true"
    # max_epochs=-1: no epoch limit, the run ends at max_steps (Lightning's _is_max_limit_reached).
    job = lightning_job(Regressor, Data, precision=None, gradient_clip_val=0.5,
                        gradient_clip_algorithm=None, max_epochs=-1, max_steps=10)
    assert job.settings == {"training.clip_grad_norm": 0.5, "max_steps": 10}
    assert lightning_job(Regressor, Data, gradient_clip_val=0.5, gradient_clip_algorithm="Value",
                         max_epochs=2).settings == {"training.clip_grad_value": 0.5, "epochs": 2}
    with pytest.raises(ConfigError, match=r"max_epochs=-1 without max_steps: .* set max_steps"):
        lightning_job(Regressor, Data, max_epochs=-1)


def test_clipping_with_the_default_algorithm_is_lightnings_clipping_by_norm():
    # Lightning clips with configure_gradient_clipping(optimizer, val, trainer's algorithm),
    # None by default; elastic's clip_grad_norm_ must give the same gradients.
    module = Regressor()
    module.trainer = L.Trainer(gradient_clip_val=0.01, accelerator="cpu", logger=False)
    module.net(torch.randn(8, 4)).pow(2).mean().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.configure_gradient_clipping(torch.optim.SGD(module.parameters(), lr=0.1),
                                       gradient_clip_val=module.trainer.gradient_clip_val,
                                       gradient_clip_algorithm=module.trainer.gradient_clip_algorithm)
    settings = lightning_job(Regressor, Data, gradient_clip_val=0.01).settings
    params = [torch.nn.Parameter(g.clone()) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, settings["training.clip_grad_norm"])
    for ours, theirs in zip(params, module.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


class _Recording(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """A ReduceLROnPlateau that records the values it is stepped on."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.seen = []

    def step(self, metrics, epoch=None):
        self.seen.append(float(metrics))
        super().step(metrics)


class _TrainPlateau(Regressor):
    """A plateau on the epoch mean of a training metric, with a validation_step too."""

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.plateau = _Recording(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": self.plateau, "monitor": "train_loss"}


class _LastValuePlateau(_TrainPlateau):
    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)  # on_epoch is False by default in training_step
        return loss


def _logged(module):
    """Records every value the module logs as `train_loss` (the step's value)."""
    values = []
    log = module.log

    def recording(name, value, *args, **kwargs):
        if name == "train_loss":
            values.append(float(value.detach()))
        log(name, value, *args, **kwargs)

    module.log = recording
    return values


def test_a_plateau_on_a_training_metric_steps_on_its_epoch_mean_as_lightnings(tmp_path):
    # Before, it was taken for a validation metric ('eval/train_loss'), which the first
    # evaluation does not have.
    lightning = _TrainPlateau()
    values = _logged(lightning)
    _fit(lightning, Data(), tmp_path, max_epochs=2, num_sanity_val_steps=0)
    per_epoch = len(values) // 2
    means = [sum(values[:per_epoch]) / per_epoch, sum(values[per_epoch:]) / per_epoch]
    assert lightning.plateau.seen == pytest.approx(means, rel=1e-6)
    job = lightning_job(_TrainPlateau, Data)
    assert job.settings == {"training.scheduler_interval": "epoch",
                            "training.scheduler_monitor": "train_loss"}
    # elastic's Training with these settings, fed the same step values, steps on the same.
    training = with_job_settings(_config(), job.settings, "the Lightning module").training
    model = job.model()
    plateau = job.lr_scheduler(job.optimizer(model))
    steps = Training(training, plateau)
    for step, value in enumerate(values):
        steps.after_step(step, 0, True, 0.0, {"train_loss": value}, step // per_epoch,
                         (step + 1) % per_epoch == 0)
    assert plateau.seen == pytest.approx(lightning.plateau.seen, rel=1e-6)
    batch = job.collate_fn([job.dataset()[i] for i in range(4)])
    assert set(job.loss(model, batch)[1]) == {"train_loss"}  # the name the scheduler reads


def test_a_plateau_on_a_training_metric_without_on_epoch_is_refused(tmp_path):
    # Lightning steps it on the epoch's last step value, which elastic does not keep.
    lightning = _LastValuePlateau()
    values = _logged(lightning)
    _fit(lightning, Data(), tmp_path, max_epochs=2, num_sanity_val_steps=0)
    per_epoch = len(values) // 2
    assert lightning.plateau.seen == pytest.approx([values[per_epoch - 1], values[-1]])
    with pytest.raises(ConfigError, match=r"monitors 'train_loss', which training_step logs "
                                          r"without on_epoch=True: .*on_epoch=True\)"):
        lightning_job(_LastValuePlateau, Data)


class _Both(_TrainPlateau):
    def validation_step(self, batch, batch_idx):
        self.log("train_loss", F.mse_loss(self.net(batch[0]), batch[1]))


def test_a_plateau_monitor_logged_by_both_steps_is_refused():
    with pytest.raises(ConfigError, match="which both training_step and validation_step log"):
        lightning_job(_Both, Data)


class _RecordsHooks:
    """Records its `prepare_data` and `setup` calls in `calls`, as `<who>.<hook>`."""

    who = ""

    def __init__(self, calls=None):
        super().__init__()
        self.calls = calls if calls is not None else []

    def prepare_data(self):
        self.calls.append(f"{self.who}.prepare_data")

    def setup(self, stage):
        # Lightning passes a str enum (TrainerFn.FITTING), equal to "fit"
        self.calls.append(f"{self.who}.setup('{'fit' if stage == 'fit' else stage}')")
        super().setup(stage)


class _Preparing(_RecordsHooks, Regressor):
    who = "module"


class _PreparingData(_RecordsHooks, Data):
    who = "datamodule"


def test_the_modules_prepare_data_runs_with_a_data_module_in_lightnings_order(tmp_path):
    # Before, the module's own prepare_data was skipped when a data module was given.
    calls = []
    _fit(_Preparing(calls), _PreparingData(calls), tmp_path, fast_dev_run=1)
    ours = []
    job = lightning_job(_Preparing, _PreparingData, calls=ours, datamodule_kwargs={"calls": ours})
    job.dataset()
    job.model()
    assert ours == calls == ["datamodule.prepare_data", "module.prepare_data",
                             "datamodule.setup('fit')", "module.setup('fit')"]


class _Skipping(Regressor):
    def training_step(self, batch, batch_idx):
        return None  # Lightning skips the batch


class _LogsMetric(Regressor):
    def __init__(self):
        super().__init__()
        from torchmetrics.classification import BinaryAccuracy

        self.accuracy = BinaryAccuracy()

    def training_step(self, batch, batch_idx):
        out = self.net(batch[0])
        self.accuracy(out.sigmoid().squeeze(1), (batch[1] > 0).long().squeeze(1))
        self.log("train_accuracy", self.accuracy)
        return F.mse_loss(out, batch[1])


@pytest.mark.parametrize(("module", "message"), [
    (_Skipping, r"training_step returned None, with which Lightning skips the batch: elastic "
                r"cannot, as every rank must do the same for a step"),
    (_LogsMetric, r"self.log\('train_accuracy', BinaryAccuracy\): elastic does not log "
                  r"torchmetrics Metric objects .* self.log\('train_accuracy', metric\(preds, "
                  r"target\)\)"),
])
def test_what_elastic_cannot_do_the_same_on_every_rank_is_refused_when_it_happens(module, message):
    job = lightning_job(module, Data)
    model = job.model()
    batch = job.collate_fn([job.dataset()[i] for i in range(4)])
    with pytest.raises(ConfigError, match=message):
        job.loss(model, batch)
