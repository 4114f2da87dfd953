"""Know the cost before the job: calibration, replay of the plan's schedule, the estimate.

``LLMOperator.estimate(prompts, sampling)`` and ``llm-operator plan --estimate`` use
``estimate.estimate``; see that module for the data flow. Spark and Dask estimate a
DataFrame in two steps: ``cost_inputs`` on the driver (calibration and a sample of rows,
with the model), then ``predict_prompts`` per partition on the workers (tokenizer only).
"""

from llm_operator.estimate.estimate import (
    CostInputs,
    Estimate,
    PartitionPrediction,
    cost_inputs,
    estimate,
    predict,
    predict_prompts,
)

__all__ = [
    "CostInputs",
    "Estimate",
    "PartitionPrediction",
    "cost_inputs",
    "estimate",
    "predict",
    "predict_prompts",
]
