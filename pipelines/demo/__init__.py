"""The shipped demo: a small Llama trained from scratch on a synthetic customer-service workload.

`python -m pipelines.demo.train` regenerates models/demo-llama/ and the data of eval_sets/ from fixed
seeds. Nothing else in the project imports this package at run time except the tests.
"""
