package lora

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// The file names of a PEFT adapter directory.
const (
	ConfigFile  = "adapter_config.json"
	WeightsFile = "adapter_model.safetensors"
)

// ErrInvalid is wrapped by every error about the content of an adapter (as
// opposed to an error reading it).
var ErrInvalid = errors.New("invalid LoRA adapter")

// Adapter is what Inspect found in an adapter directory.
type Adapter struct {
	// Rank is the adapter's r (the largest one when rank_pattern sets
	// others for some modules).
	Rank int
	// Alpha is lora_alpha.
	Alpha float64
	// TargetModules are the modules the adapter applies to: the list from
	// the config, or the one pattern when the config gives a string.
	TargetModules []string
	// BaseModel is base_model_name_or_path (may be empty).
	BaseModel string
	// Tensors is the number of tensors in the weights file.
	Tensors int
	// Bytes is the size of the weights file.
	Bytes int64
}

// Inspect checks the adapter in dir: its config, its safetensors header, and
// that the tensors agree with the config (lora_A [r, in] and lora_B [out, r]
// for every module, every target module covered). It reads the header of the
// weights file, never the weights themselves.
func Inspect(dir string) (Adapter, error) {
	cfg, err := readConfig(filepath.Join(dir, ConfigFile))
	if err != nil {
		return Adapter{}, err
	}
	f, err := os.Open(filepath.Join(dir, WeightsFile))
	if err != nil {
		return Adapter{}, fmt.Errorf("opening %s: %w", WeightsFile, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Adapter{}, fmt.Errorf("reading %s: %w", WeightsFile, err)
	}
	if !st.Mode().IsRegular() {
		return Adapter{}, fmt.Errorf("%s: not a regular file: %w", WeightsFile, ErrInvalid)
	}
	tensors, err := ReadSafetensors(f, st.Size())
	if err != nil {
		return Adapter{}, fmt.Errorf("%s: %w", WeightsFile, err)
	}
	if err := check(cfg, tensors); err != nil {
		return Adapter{}, err
	}
	a := Adapter{
		Rank:      cfg.Rank,
		Alpha:     cfg.Alpha,
		BaseModel: cfg.BaseModel,
		Tensors:   len(tensors),
		Bytes:     st.Size(),
	}
	for _, r := range cfg.RankPattern {
		a.Rank = max(a.Rank, r)
	}
	if cfg.TargetPattern != "" {
		a.TargetModules = []string{cfg.TargetPattern}
	} else {
		a.TargetModules = append([]string(nil), cfg.TargetModules...)
	}
	return a, nil
}

func readConfig(path string) (Config, error) {
	f, err := os.Open(path)
	if err != nil {
		return Config{}, fmt.Errorf("opening %s: %w", ConfigFile, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxConfigBytes+1))
	if err != nil {
		return Config{}, fmt.Errorf("reading %s: %w", ConfigFile, err)
	}
	if len(b) > MaxConfigBytes {
		return Config{}, fmt.Errorf("%s: larger than %d bytes: %w", ConfigFile, MaxConfigBytes, ErrInvalid)
	}
	cfg, err := ParseConfig(b)
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", ConfigFile, err)
	}
	return cfg, nil
}

// peftPrefix starts the tensor names PEFT saves.
const peftPrefix = "base_model.model."

// loraTensor splits a PEFT tensor name "<module>.lora_A.weight" (or lora_B)
// into the module and the matrix, A or B.
func loraTensor(name string) (module string, matrix byte, ok bool) {
	for _, m := range []byte{'A', 'B'} {
		suffix := ".lora_" + string(m) + ".weight"
		if mod, found := strings.CutSuffix(name, suffix); found && mod != "" {
			return mod, m, true
		}
	}
	return "", 0, false
}

// targets reports whether module is one the config targets, with PEFT's
// rule: a list entry matches the module's full name or its last components;
// a string is a regular expression over the full name.
func (c Config) targets(module string, re *regexp.Regexp) bool {
	if re != nil {
		// PEFT matches the pattern against the model's own module names,
		// which the saved tensor names prefix with "base_model.model.".
		return re.MatchString(module) || re.MatchString(strings.TrimPrefix(module, peftPrefix))
	}
	for _, t := range c.TargetModules {
		if module == t || strings.HasSuffix(module, "."+t) {
			return true
		}
	}
	return false
}

// check matches the tensors against the config.
func check(cfg Config, tensors []Tensor) error {
	ranks := map[int64]bool{int64(cfg.Rank): true}
	for _, r := range cfg.RankPattern {
		ranks[int64(r)] = true
	}
	var re *regexp.Regexp
	if cfg.TargetPattern != "" && cfg.TargetPattern != allLinear {
		var err error
		if re, err = regexp.Compile(`^(?:` + cfg.TargetPattern + `)$`); err != nil {
			return fmt.Errorf("%s: target_modules %q is not a pattern Go can match: %w", ConfigFile, cfg.TargetPattern, ErrInvalid)
		}
	}
	type pair struct {
		a, b *Tensor
	}
	modules := map[string]*pair{}
	for i := range tensors {
		t := &tensors[i]
		mod, m, ok := loraTensor(t.Name)
		if !ok {
			continue
		}
		if len(t.Shape) != 2 {
			return fmt.Errorf("%s: tensor %s: shape %v is not a matrix: %w", WeightsFile, t.Name, t.Shape, ErrInvalid)
		}
		p := modules[mod]
		if p == nil {
			p = &pair{}
			modules[mod] = p
		}
		if m == 'A' {
			if !ranks[t.Shape[0]] {
				return fmt.Errorf("%s: tensor %s: shape %v, want [r=%d, in]: %w", WeightsFile, t.Name, t.Shape, cfg.Rank, ErrInvalid)
			}
			p.a = t
		} else {
			if !ranks[t.Shape[1]] {
				return fmt.Errorf("%s: tensor %s: shape %v, want [out, r=%d]: %w", WeightsFile, t.Name, t.Shape, cfg.Rank, ErrInvalid)
			}
			p.b = t
		}
	}
	if len(modules) == 0 {
		return fmt.Errorf("%s: no lora_A/lora_B tensors: %w", WeightsFile, ErrInvalid)
	}
	names := make([]string, 0, len(modules))
	for mod := range modules {
		names = append(names, mod)
	}
	sort.Strings(names)
	for _, mod := range names {
		p := modules[mod]
		switch {
		case p.a == nil:
			return fmt.Errorf("%s: module %s has lora_B but no lora_A: %w", WeightsFile, mod, ErrInvalid)
		case p.b == nil:
			return fmt.Errorf("%s: module %s has lora_A but no lora_B: %w", WeightsFile, mod, ErrInvalid)
		case p.a.Shape[0] != p.b.Shape[1]:
			return fmt.Errorf("%s: module %s: lora_A rank %d and lora_B rank %d differ: %w", WeightsFile, mod, p.a.Shape[0], p.b.Shape[1], ErrInvalid)
		}
		if cfg.TargetPattern != allLinear && !cfg.targets(mod, re) {
			return fmt.Errorf("%s: module %s is not among target_modules: %w", WeightsFile, mod, ErrInvalid)
		}
	}
	if re != nil || cfg.TargetPattern == allLinear {
		return nil
	}
	for _, t := range cfg.TargetModules {
		found := false
		for _, mod := range names {
			if mod == t || strings.HasSuffix(mod, "."+t) {
				found = true
				break
			}
		}
		if !found {
			return fmt.Errorf("%s: target module %s has no lora_A/lora_B tensors: %w", WeightsFile, t, ErrInvalid)
		}
	}
	return nil
}
