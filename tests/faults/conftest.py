"""Shared fixtures (see tests/_helpers.py): a module's private emulated machine, the seeds'
example model for the module's SHAPE and its weights, the gather model, one IPU, a daemon."""

from tests._helpers import (daemon, device, gather_model, gather_path, model, model_path,  # noqa: F401
                            private_machine, weights)
