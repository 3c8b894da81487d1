# Types of ``guideloom.io``: at run time it is the module ``guideloom_pipes.io`` itself.
from guideloom_pipes.io import *  # noqa: F403
