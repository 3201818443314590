"""A TrainingService objective for the fault tests, named by ``loss_fn="tests.rlhf.service_objectives:..."``."""

from megalite.rlhf.objectives import LanguageModelObjective


class FailingLanguageModel(LanguageModelObjective):
    """The language-model loss, but a micro-batch with a nonzero ``fail`` entry raises IndexError in its forward."""

    def forward(self, chunk, mb: dict):
        if bool(mb["fail"].any()):
            raise IndexError("index out of range in self (test failure)")
        return super().forward(chunk, mb)
