"""Query temperatures: each query multiplied by a factor of its position (or of how many keys it attends), after an
inner encoding's hooks (Llama 4's attention temperature tuning, Mistral 3's β scaling, Scalable-Softmax)."""
