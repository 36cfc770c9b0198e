"""Accuracy as an ``evaluate`` metric that loads from this folder, with no network.

``evaluate.load("accuracy")`` fetches its script from the Hugging Face Hub; the fine-tune job must
run offline, so it loads this one with ``evaluate.load("metrics/accuracy")`` instead.
"""

import datasets
import evaluate


class Accuracy(evaluate.Metric):
    """Fraction of predictions equal to the references."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the references.",
            citation="",
            inputs_description="predictions: list of int labels; references: list of int labels",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions: list[int], references: list[int]) -> dict[str, float]:
        correct = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": correct / max(1, len(references))}
