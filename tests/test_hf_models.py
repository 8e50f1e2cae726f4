"""Real models nobody here wrote: Hugging Face GPT-2 and Llama from small random configs
(``transformers`` from the package registry, a test extra; nothing is downloaded) train
under every dp mode and match the single-device model, as tests/test_parity.py states."""
import pytest

from jobs import hf
from jobs.common import MODES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports(ranks):
    return ranks(hf.hf_parity_all, 2, timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_parity(reports, name, mode):
    for r in reports:
        rep = r[(name, mode)]
        assert rep.ok, (f"{name} {mode} rank {rep.rank}: output {rep.output_err:.3g} loss {rep.loss_err:.3g} "
                        f"grad {rep.grad_err:.3g} param {rep.param_err:.3g} noise {rep.noise_param_err:.3g}")
        assert rep.ref_losses[-1] < rep.ref_losses[0]
