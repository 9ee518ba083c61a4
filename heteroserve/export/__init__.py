"""Ahead-of-time export of a loaded decoder to ONNX graphs for vendor graph compilers and onnxruntime.

`graph_module.py` restates the decoder in plain, traceable torch with the KV cache as explicit inputs and outputs;
`onnx_export.py` traces it into a prefill and a decode graph and writes `config.json` beside them;
`onnx_runner.py` runs the exported graphs with onnxruntime under the shapes `config.json` promises.
"""
