"""Train on arithmetic word problems (exact-match reward):
`python -m environments.arithmetic --model Qwen/Qwen2.5-0.5B-Instruct --steps 20`."""

from environments.arithmetic import ArithmeticTask
from environments.common import main

main(ArithmeticTask(), __doc__)
