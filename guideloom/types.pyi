# Types of ``guideloom.types``: at run time it is the module ``guideloom_pipes.types`` itself.
from guideloom_pipes.types import *  # noqa: F403
