"""The ``onnx`` target (:mod:`.target`): attention as ONNX functions (:mod:`.functions`), the
exporter and loader (:mod:`.export`) and the onnxruntime session runner (:mod:`.session`)."""
