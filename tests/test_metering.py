import pytest
import torch

from finetune.metering import TrainingMeter


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
