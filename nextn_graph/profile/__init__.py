"""A work profile of one speculative decoding round: kernels, bytes touched and FLOPs,
per phase and per module kind, beside the ideal (weights read once, active experts
only) and a roofline projection for a named device. The models are built on the
``meta`` device, so a full-size model (``--preset v4-flash``) needs no memory.

``profile_round(cfg, ProfileSettings(...), source)`` is the library entry point;
``nextn-graph profile`` the command (``command.py``); ``docs/profile.md`` the guide.
"""

from .build import ProfileSettings
from .command import add_profile_options, run_profile
from .run import profile_round
from .specs import DEVICE_SPECS, DeviceSpec

__all__ = ["DEVICE_SPECS", "DeviceSpec", "ProfileSettings", "add_profile_options",
           "profile_round", "run_profile"]
