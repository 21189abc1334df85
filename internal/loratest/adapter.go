// Package loratest holds test kits for LoRA adapters: a writer of valid PEFT
// adapter directories, and loopback HTTP servers that follow the runtime
// adapter APIs of vLLM and SGLang closely, open the staged adapter files the
// way the runtimes do, and inject faults on demand.
package loratest

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/weightd/weightd/pkg/lora"
)

// AdapterSpec describes the adapter WriteAdapter makes.
type AdapterSpec struct {
	// Rank is r; 8 when zero.
	Rank int
	// Alpha is lora_alpha; twice the rank when zero.
	Alpha float64
	// Modules are the target modules; q_proj and v_proj when empty.
	Modules []string
	// Hidden is the in and out size of every module; 64 when zero.
	Hidden int
	// Layers is the number of decoder layers; 2 when zero.
	Layers int
	// Base is base_model_name_or_path.
	Base string
}

func (s AdapterSpec) withDefaults() AdapterSpec {
	if s.Rank == 0 {
		s.Rank = 8
	}
	if s.Alpha == 0 {
		s.Alpha = float64(2 * s.Rank)
	}
	if len(s.Modules) == 0 {
		s.Modules = []string{"q_proj", "v_proj"}
	}
	if s.Hidden == 0 {
		s.Hidden = 64
	}
	if s.Layers == 0 {
		s.Layers = 2
	}
	return s
}

// WriteAdapter writes a valid PEFT LoRA adapter into dir (created if
// missing): adapter_config.json and adapter_model.safetensors with F16
// tensors named as PEFT names them, lora_A [r, hidden] and lora_B
// [hidden, r] for every module of every layer. The weights are a
// deterministic pattern.
func WriteAdapter(dir string, s AdapterSpec) error {
	s = s.withDefaults()
	if s.Rank < 0 || s.Hidden < 0 || s.Layers < 0 {
		return errors.New("loratest: negative rank, hidden size or layer count")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", dir, err)
	}
	cfg, err := json.MarshalIndent(map[string]any{
		"peft_type":               "LORA",
		"task_type":               "CAUSAL_LM",
		"r":                       s.Rank,
		"lora_alpha":              s.Alpha,
		"lora_dropout":            0.05,
		"bias":                    "none",
		"target_modules":          s.Modules,
		"base_model_name_or_path": s.Base,
		"inference_mode":          true,
	}, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding the config: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, lora.ConfigFile), cfg, 0o644); err != nil {
		return fmt.Errorf("writing the config: %w", err)
	}
	weights, err := safetensors(s)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, lora.WeightsFile), weights, 0o644); err != nil {
		return fmt.Errorf("writing the weights: %w", err)
	}
	return nil
}

// safetensors encodes the adapter's tensors.
func safetensors(s AdapterSpec) ([]byte, error) {
	type entry struct {
		DType       string   `json:"dtype"`
		Shape       []int    `json:"shape"`
		DataOffsets [2]int64 `json:"data_offsets"`
	}
	var names []string
	shapes := map[string][]int{}
	for layer := range s.Layers {
		for _, m := range s.Modules {
			prefix := fmt.Sprintf("base_model.model.model.layers.%d.self_attn.%s", layer, m)
			shapes[prefix+".lora_A.weight"] = []int{s.Rank, s.Hidden}
			shapes[prefix+".lora_B.weight"] = []int{s.Hidden, s.Rank}
			names = append(names, prefix+".lora_A.weight", prefix+".lora_B.weight")
		}
	}
	sort.Strings(names)
	header := map[string]any{"__metadata__": map[string]string{"format": "pt"}}
	var off int64
	for _, n := range names {
		size := int64(shapes[n][0]) * int64(shapes[n][1]) * 2
		header[n] = entry{DType: "F16", Shape: shapes[n], DataOffsets: [2]int64{off, off + size}}
		off += size
	}
	h, err := json.Marshal(header)
	if err != nil {
		return nil, fmt.Errorf("encoding the safetensors header: %w", err)
	}
	// Pad the header to 8 bytes with spaces, as the reference writer does.
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	out := make([]byte, 8, 8+int64(len(h))+off)
	binary.LittleEndian.PutUint64(out, uint64(len(h)))
	out = append(out, h...)
	for i := range off {
		out = append(out, byte(i*7+3))
	}
	return out, nil
}
