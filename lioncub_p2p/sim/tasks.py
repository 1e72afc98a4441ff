"""The simulators' tasks; they live in ``lioncub_p2p.tasks`` (the CLI trains them too), named here
for the simulators, examples and tests that import them from the simulator package."""
from ..tasks.byte_gpt import ByteGPT, ByteLMTask, stdlib_bytes_task
from ..tasks.digits import Task, digits_task

__all__ = ["ByteGPT", "ByteLMTask", "Task", "digits_task", "stdlib_bytes_task"]
