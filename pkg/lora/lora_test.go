package lora_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/lora"
)

func writeAdapter(t *testing.T, s loratest.AdapterSpec) string {
	t.Helper()
	dir := t.TempDir()
	if err := loratest.WriteAdapter(dir, s); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestInspectValid(t *testing.T) {
	t.Parallel()
	dir := writeAdapter(t, loratest.AdapterSpec{Rank: 16, Modules: []string{"q_proj", "k_proj", "v_proj"}, Hidden: 32, Layers: 3, Base: "org/base"})
	a, err := lora.Inspect(dir)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, lora.WeightsFile))
	if err != nil {
		t.Fatal(err)
	}
	if a.Rank != 16 || a.Alpha != 32 || a.BaseModel != "org/base" || a.Tensors != 3*3*2 || a.Bytes != st.Size() {
		t.Fatalf("got %+v", a)
	}
	if strings.Join(a.TargetModules, ",") != "q_proj,k_proj,v_proj" {
		t.Fatalf("target modules %v", a.TargetModules)
	}
}

// rewriteConfig edits the adapter's config as a map.
func rewriteConfig(t *testing.T, dir string, edit func(m map[string]any)) {
	t.Helper()
	p := filepath.Join(dir, lora.ConfigFile)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	if b, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// safetensorsFile builds a safetensors file from a header and data size.
func safetensorsFile(header any, data int) []byte {
	h, err := json.Marshal(header)
	if err != nil {
		panic(err)
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
	out = append(out, h...)
	return append(out, make([]byte, data)...)
}

func tensor(dtype string, shape []int, begin, end int) map[string]any {
	return map[string]any{"dtype": dtype, "shape": shape, "data_offsets": []int{begin, end}}
}

func TestInspectConfigErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		edit func(m map[string]any)
		want string
	}{
		{"rank zero", func(m map[string]any) { m["r"] = 0 }, "adapter_config.json: r is 0"},
		{"rank missing", func(m map[string]any) { delete(m, "r") }, "r missing"},
		{"rank fraction", func(m map[string]any) { m["r"] = 1.5 }, "not an integer"},
		{"not lora", func(m map[string]any) { m["peft_type"] = "PREFIX_TUNING" }, `peft_type is "PREFIX_TUNING"`},
		{"alpha", func(m map[string]any) { m["lora_alpha"] = -1 }, "lora_alpha is -1"},
		{"no targets", func(m map[string]any) { m["target_modules"] = []string{} }, "target_modules is empty"},
		{"targets wrong type", func(m map[string]any) { m["target_modules"] = 7 }, "neither a list"},
		{"target without tensors", func(m map[string]any) { m["target_modules"] = []string{"q_proj", "v_proj", "o_proj"} }, "target module o_proj has no lora_A/lora_B tensors"},
		{"tensor outside targets", func(m map[string]any) { m["target_modules"] = []string{"q_proj"} }, "v_proj is not among target_modules"},
		{"rank disagrees with shapes", func(m map[string]any) { m["r"] = 4 }, "want [r=4, in]"},
		{"pattern misses", func(m map[string]any) { m["target_modules"] = `.*\.o_proj` }, "is not among target_modules"},
		{"bad pattern", func(m map[string]any) { m["target_modules"] = `(` }, "not a pattern"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := writeAdapter(t, loratest.AdapterSpec{})
			rewriteConfig(t, dir, tc.edit)
			_, err := lora.Inspect(dir)
			if !errors.Is(err, lora.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}

func TestInspectTargetForms(t *testing.T) {
	t.Parallel()
	for _, targets := range []any{`.*\.(q_proj|v_proj)`, `model\.layers\.\d+\.self_attn\.(q|v)_proj`, "all-linear", []string{"self_attn.q_proj", "v_proj"}} {
		dir := writeAdapter(t, loratest.AdapterSpec{})
		rewriteConfig(t, dir, func(m map[string]any) { m["target_modules"] = targets })
		if _, err := lora.Inspect(dir); err != nil {
			t.Errorf("target_modules %v: %v", targets, err)
		}
	}
}

func TestInspectMissingFiles(t *testing.T) {
	t.Parallel()
	if _, err := lora.Inspect(t.TempDir()); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("empty dir: %v", err)
	}
	dir := writeAdapter(t, loratest.AdapterSpec{})
	if err := os.Remove(filepath.Join(dir, lora.WeightsFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := lora.Inspect(dir); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), lora.WeightsFile) {
		t.Fatalf("no weights: %v", err)
	}
}

func TestInspectTruncatedWeights(t *testing.T) {
	t.Parallel()
	dir := writeAdapter(t, loratest.AdapterSpec{})
	p := filepath.Join(dir, lora.WeightsFile)
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, st.Size()-10); err != nil {
		t.Fatal(err)
	}
	_, err = lora.Inspect(dir)
	if !errors.Is(err, lora.ErrInvalid) || !strings.Contains(err.Error(), "past the end of the file") {
		t.Fatalf("got %v", err)
	}
}

func TestSafetensorsErrors(t *testing.T) {
	t.Parallel()
	a := "m.q_proj.lora_A.weight"
	for _, tc := range []struct {
		name string
		file []byte
		want string
	}{
		{"short", []byte{1, 2, 3}, "shorter than the 8-byte header length"},
		{"huge header length", binary.LittleEndian.AppendUint64(nil, 1<<40), "over"},
		{"header past end", append(binary.LittleEndian.AppendUint64(nil, 100), '{', '}'), "header length 100 past the end of the file"},
		{"not an object", safetensorsFile([]int{1}, 0), "not a JSON object"},
		{"unknown dtype", safetensorsFile(map[string]any{a: tensor("F12", []int{2, 2}, 0, 8)}, 8), `unknown dtype "F12"`},
		{"offsets past end", safetensorsFile(map[string]any{a: tensor("F16", []int{2, 2}, 0, 8)}, 4), "tensor m.q_proj.lora_A.weight: data_offsets [0,8) past the end of the file (4 data bytes)"},
		{"size mismatch", safetensorsFile(map[string]any{a: tensor("F32", []int{2, 2}, 0, 8)}, 8), "is 16 bytes"},
		{"overlap", safetensorsFile(map[string]any{"x": tensor("U8", []int{4}, 0, 4), "y": tensor("U8", []int{4}, 2, 6)}, 6), "overlap"},
		{"hole", safetensorsFile(map[string]any{"x": tensor("U8", []int{4}, 0, 4), "y": tensor("U8", []int{2}, 6, 8)}, 8), "hole"},
		{"trailing bytes", safetensorsFile(map[string]any{"x": tensor("U8", []int{4}, 0, 4)}, 6), "cover 4 of the 6"},
		{"reversed", safetensorsFile(map[string]any{"x": tensor("U8", []int{0}, 4, 0)}, 4), "out of order"},
		{"overflow", safetensorsFile(map[string]any{"x": tensor("F64", []int{1 << 40, 1 << 40}, 0, 0)}, 0), "overflow"},
		{"bad metadata", safetensorsFile(map[string]any{"__metadata__": map[string]int{"a": 1}}, 0), "__metadata__"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := lora.ReadSafetensors(bytes.NewReader(tc.file), int64(len(tc.file)))
			if !errors.Is(err, lora.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}

func TestInspectShapeErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		tensors map[string]any
		data    int
		want    string
	}{
		{"B without A", map[string]any{"m.q_proj.lora_B.weight": tensor("U8", []int{4, 8}, 0, 32)}, 32, "has lora_B but no lora_A"},
		{"A without B", map[string]any{"m.q_proj.lora_A.weight": tensor("U8", []int{8, 4}, 0, 32)}, 32, "has lora_A but no lora_B"},
		{"vector", map[string]any{"m.q_proj.lora_A.weight": tensor("U8", []int{8}, 0, 8)}, 8, "not a matrix"},
		{"B rank", map[string]any{
			"m.q_proj.lora_A.weight": tensor("U8", []int{8, 4}, 0, 32),
			"m.q_proj.lora_B.weight": tensor("U8", []int{4, 2}, 32, 40),
		}, 40, "want [out, r=8]"},
		{"no lora tensors", map[string]any{"lm_head.weight": tensor("U8", []int{2}, 0, 2)}, 2, "no lora_A/lora_B tensors"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := writeAdapter(t, loratest.AdapterSpec{Modules: []string{"q_proj"}})
			if err := os.WriteFile(filepath.Join(dir, lora.WeightsFile), safetensorsFile(tc.tensors, tc.data), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := lora.Inspect(dir)
			if !errors.Is(err, lora.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}

func TestConfigTooLarge(t *testing.T) {
	t.Parallel()
	dir := writeAdapter(t, loratest.AdapterSpec{})
	big := append([]byte(`{"pad":"`), bytes.Repeat([]byte("x"), lora.MaxConfigBytes)...)
	big = append(big, `"}`...)
	if err := os.WriteFile(filepath.Join(dir, lora.ConfigFile), big, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := lora.Inspect(dir); !errors.Is(err, lora.ErrInvalid) || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("got %v", err)
	}
}

func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"peft_type":"LORA","r":8,"lora_alpha":16,"target_modules":["q_proj","v_proj"],"base_model_name_or_path":"b"}`))
	f.Add([]byte(`{"peft_type":"LORA","r":8,"lora_alpha":16,"target_modules":".*q_proj","rank_pattern":{"q":4}}`))
	f.Add([]byte(`{"peft_type":"LORA","r":1e400,"lora_alpha":"x","target_modules":null}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		cfg, err := lora.ParseConfig(b)
		if err != nil {
			if !errors.Is(err, lora.ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		if cfg.Rank <= 0 || cfg.Alpha <= 0 || (len(cfg.TargetModules) == 0) == (cfg.TargetPattern == "") {
			t.Fatalf("accepted %+v", cfg)
		}
	})
}

func FuzzParseSafetensorsHeader(f *testing.F) {
	f.Add([]byte(`{"__metadata__":{"format":"pt"},"a.lora_A.weight":{"dtype":"F16","shape":[2,4],"data_offsets":[0,16]}}`), int64(16))
	f.Add([]byte(`{"x":{"dtype":"BF16","shape":[],"data_offsets":[0,2]}}   `), int64(2))
	f.Add([]byte(`{"x":{"dtype":"U8","shape":[9223372036854775807,2],"data_offsets":[0,0]}}`), int64(0))
	f.Fuzz(func(t *testing.T, header []byte, dataSize int64) {
		tensors, err := lora.ParseSafetensorsHeader(header, dataSize)
		if err != nil {
			if !errors.Is(err, lora.ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		var next int64
		for _, ts := range tensors {
			if ts.Begin != next || ts.End < ts.Begin || ts.End > dataSize {
				t.Fatalf("accepted %+v after %d (data %d)", ts, next, dataSize)
			}
			next = ts.End
		}
		if next != dataSize {
			t.Fatalf("accepted tensors covering %d of %d", next, dataSize)
		}
	})
}

func FuzzReadSafetensors(f *testing.F) {
	f.Add(safetensorsFile(map[string]any{"x": tensor("U8", []int{4}, 0, 4)}, 4))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, file []byte) {
		if _, err := lora.ReadSafetensors(bytes.NewReader(file), int64(len(file))); err != nil && !errors.Is(err, lora.ErrInvalid) {
			t.Fatalf("error %v does not wrap ErrInvalid", err)
		}
	})
}

func BenchmarkInspect(b *testing.B) {
	for _, s := range []loratest.AdapterSpec{
		{Rank: 8, Hidden: 64, Layers: 2},
		{Rank: 16, Hidden: 256, Layers: 32, Modules: []string{"q_proj", "k_proj", "v_proj", "o_proj"}},
	} {
		b.Run(fmt.Sprintf("layers=%d,modules=%d", s.Layers, max(len(s.Modules), 2)), func(b *testing.B) {
			dir := b.TempDir()
			if err := loratest.WriteAdapter(dir, s); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if _, err := lora.Inspect(dir); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
