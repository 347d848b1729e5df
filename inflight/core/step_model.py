"""An online model of how long a step takes, for SLO-aware scheduling. Torch-free.

Step time grows about linearly with the tokens computed in the step (the weights are read
once, then every token adds matmul work): ``t ~= a + b * num_tokens``. The fit is least
squares over exponentially decayed sums, so it follows the machine as load and context
lengths drift. Until it has seen enough steps it predicts nothing and callers fall back to
their static knobs.
"""

from __future__ import annotations


class StepTimeModel:
    """``seconds ~= intercept + slope * num_batched_tokens``, refit after every step.

    Args:
        decay: weight kept by old observations per new one (0.98: ~50-step memory).
        min_observations: steps needed before ``ready``.
    """

    def __init__(self, decay: float = 0.98, min_observations: int = 8) -> None:
        self.decay = decay
        self.min_observations = min_observations
        self.num_observations = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one step: ``num_tokens`` computed in ``seconds``."""
        d = self.decay
        x, y = float(num_tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y
        self.num_observations += 1

    @property
    def ready(self) -> bool:
        return self.num_observations >= self.min_observations

    def coefficients(self) -> tuple[float, float]:
        """``(intercept seconds, slope seconds per token)``; slope >= 0, intercept >= 0."""
        if self._w == 0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        slope = (self._xy / self._w - mx * my) / var if var > 1e-9 else (my / mx if mx else 0.0)
        slope = max(slope, 0.0)
        return max(my - slope * mx, 0.0), slope

    def predict(self, num_tokens: int) -> float:
        """Predicted seconds for a step of ``num_tokens`` tokens."""
        a, b = self.coefficients()
        return a + b * num_tokens

    def time_to_prefill(self, num_tokens: int, budget: int, num_running: int,
                        step_tokens: int | None = None) -> float:
        """Seconds until ``num_tokens`` prompt tokens are computed: steps of ``budget``
        tokens less one decode token per running request (``num_running``), each taking
        the predicted time for ``step_tokens`` tokens (default ``budget``)."""
        per_step = max(budget - num_running, 1)
        return -(-num_tokens // per_step) * self.predict(budget if step_tokens is None else step_tokens)

    def max_tokens_within(self, seconds: float) -> int | None:
        """Most tokens a step can hold and still take at most ``seconds``; None if unknown.
        Before the fit is ``ready`` it answers from the first two or more steps (their line,
        or their mean rate if they were the same size), which pay one-time costs and so err
        short; None before two steps."""
        a, b = self.coefficients()
        if self.num_observations < 2 or b <= 0:
            return None
        return max(int((seconds - a) / b + 1e-6), 0)  # 1e-6: float noise, not a token
