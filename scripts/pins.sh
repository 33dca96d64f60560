# The mlx-vlm pin matrix: one place that says what each environment holds.
ALL_PINS=(0.3.9 0.4.4 0.6.12 0.7.10)
# The pin whose environment also holds torch + transformers >= 5.21 (the reference oracle).
REFERENCE_PIN=0.7.10

pin_requirements() {
  case "$1" in
    0.3.9)  echo "mlx[cpu]==0.30.0 mlx-vlm==0.3.9 mlx-lm==0.28.4 transformers==4.57.6 safetensors numpy pillow" ;;
    0.4.4)  echo "mlx[cpu] mlx-vlm==0.4.4 mlx-lm>=0.31 safetensors numpy pillow" ;;
    0.6.12) echo "mlx[cpu] mlx-vlm==0.6.12 mlx-lm>=0.31.3 safetensors numpy pillow" ;;
    0.7.10) echo "mlx[cpu] mlx-vlm==0.7.10 mlx-lm>=0.31.3 transformers>=5.21 safetensors numpy pillow" ;;
    *) echo "unknown pin $1" >&2; return 1 ;;
  esac
}

pin_has_torch() { [ "$1" = "$REFERENCE_PIN" ]; }
