"""Privacy for split learning: DP-SGD on the client parts, noise at the cut, and privacy accounting.

* :class:`PrivateTraining`: opacus DP-SGD on bottom + top (per-example clipping and
  noise, Poisson batches, accountant state as plain lists for Flower's ``context.state``).
* :class:`CutNoise` and :func:`clip_and_noise`: clip-and-noise of the activations a
  client sends (inputs) and of the gradients it sends back (labels).
* :class:`PrivacyConfig` and :class:`ClientPrivacy`: the run-config keys and the few
  lines a client round needs. See ``docs/privacy.md`` for what each knob protects.
"""

from splitfed.privacy.accounting import Accountant, noise_for_epsilon
from splitfed.privacy.client import ClientPrivacy, PrivacyConfig, install_eval_noise
from splitfed.privacy.cut import CutNoise, clip_and_noise
from splitfed.privacy.dpsgd import PrivateTraining, prepare_for_opacus

__all__ = ["Accountant", "ClientPrivacy", "CutNoise", "PrivacyConfig", "PrivateTraining", "clip_and_noise",
           "install_eval_noise", "noise_for_epsilon", "prepare_for_opacus"]
