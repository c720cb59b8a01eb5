import pytest
import torch

from finetune.observability.metering import TrainingMeter


def test_losses_are_means_over_loss_units_of_every_process_and_totals_span_every_interval():
    doubled = TrainingMeter(torch.device("cpu"), lambda values: values * 2)  # a second process with the same batches
    doubled.add(torch.tensor(6.0), units=3, examples=1, real_tokens=3, processed_tokens=4)
    doubled.add(torch.tensor(2.0), units=1, examples=1, real_tokens=1, processed_tokens=4)
    first = doubled.interval()
    assert first["loss"] == 2.0 and first["samples_per_second"] > 0
    doubled.add(torch.tensor(1.0), units=1, examples=1, real_tokens=2, processed_tokens=2)
    assert doubled.interval()["loss"] == 1.0, "the second interval starts from zero"
    totals = doubled.totals()
    assert totals["train_loss"] == pytest.approx((16 + 2) / (8 + 2))
    assert totals["padding_efficiency"] == pytest.approx(6 / 10)
    assert totals["train_samples_per_second"] == pytest.approx(6 / totals["train_runtime"])
    assert totals["train_tokens_per_second"] == pytest.approx(12 / totals["train_runtime"])


def test_a_task_s_figures_are_summed_and_reduced_with_the_loss_and_logged_per_loss_unit():
    doubled = TrainingMeter(torch.device("cpu"), lambda values: values * 2, figures=("reward", "hits"))
    doubled.add(torch.tensor(3.0), units=2, examples=2, real_tokens=4, processed_tokens=4,
                figures={"reward": torch.tensor(1.0), "hits": torch.tensor(2.0)})
    doubled.add(torch.tensor(1.0), units=2, examples=2, real_tokens=4, processed_tokens=4,
                figures={"reward": torch.tensor(-3.0), "hits": torch.tensor(1.0), "unlisted": torch.tensor(9.0)})
    logs = doubled.interval()
    assert (logs["loss"], logs["reward"], logs["hits"]) == (1.0, -0.5, 0.75) and "unlisted" not in logs
    doubled.add(torch.tensor(1.0), units=1, examples=1, real_tokens=2, processed_tokens=2,
                figures={"reward": torch.tensor(2.0), "hits": torch.tensor(0.0)})
    assert doubled.interval()["reward"] == 2.0, "the second interval starts from zero"
