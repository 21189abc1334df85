package lora

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
)

// MaxConfigBytes bounds adapter_config.json; real ones are about a kilobyte.
const MaxConfigBytes = 1 << 20

// maxRank bounds r: the largest ranks in use are in the hundreds.
const maxRank = 1 << 16

// maxTargets bounds the number of target modules.
const maxTargets = 4096

// allLinear is PEFT's shorthand for every linear layer but the output one.
const allLinear = "all-linear"

// Config is what weightd reads from adapter_config.json.
type Config struct {
	Rank  int
	Alpha float64
	// TargetModules is target_modules when the config lists them.
	TargetModules []string
	// TargetPattern is target_modules when the config gives one string: a
	// regular expression over module names, or "all-linear".
	TargetPattern string
	// RankPattern is rank_pattern: other ranks for some modules.
	RankPattern map[string]int
	BaseModel   string
}

type rawConfig struct {
	PeftType      *string         `json:"peft_type"`
	R             *json.Number    `json:"r"`
	Alpha         *json.Number    `json:"lora_alpha"`
	TargetModules json.RawMessage `json:"target_modules"`
	RankPattern   map[string]int  `json:"rank_pattern"`
	BaseModel     *string         `json:"base_model_name_or_path"`
}

// ParseConfig parses and checks the content of adapter_config.json: peft_type
// LORA, a positive integer r, a finite lora_alpha, target_modules as a
// non-empty list of names or one string.
func ParseConfig(b []byte) (Config, error) {
	if len(b) > MaxConfigBytes {
		return Config{}, fmt.Errorf("larger than %d bytes: %w", MaxConfigBytes, ErrInvalid)
	}
	var raw rawConfig
	if err := json.Unmarshal(b, &raw); err != nil {
		return Config{}, fmt.Errorf("parsing JSON: %v: %w", err, ErrInvalid)
	}
	if raw.PeftType == nil {
		return Config{}, fmt.Errorf("peft_type missing: %w", ErrInvalid)
	}
	if !strings.EqualFold(*raw.PeftType, "LORA") {
		return Config{}, fmt.Errorf("peft_type is %q, not LORA: %w", *raw.PeftType, ErrInvalid)
	}
	var cfg Config
	if raw.R == nil {
		return Config{}, fmt.Errorf("r missing: %w", ErrInvalid)
	}
	r, err := raw.R.Int64()
	switch {
	case err != nil:
		return Config{}, fmt.Errorf("r is %s, not an integer: %w", raw.R, ErrInvalid)
	case r <= 0:
		return Config{}, fmt.Errorf("r is %d: %w", r, ErrInvalid)
	case r > maxRank:
		return Config{}, fmt.Errorf("r is %d, over %d: %w", r, maxRank, ErrInvalid)
	}
	cfg.Rank = int(r)
	if raw.Alpha == nil {
		return Config{}, fmt.Errorf("lora_alpha missing: %w", ErrInvalid)
	}
	alpha, err := raw.Alpha.Float64()
	if err != nil || math.IsNaN(alpha) || math.IsInf(alpha, 0) || alpha <= 0 {
		return Config{}, fmt.Errorf("lora_alpha is %s: %w", raw.Alpha, ErrInvalid)
	}
	cfg.Alpha = alpha
	for k, v := range raw.RankPattern {
		if v <= 0 || v > maxRank {
			return Config{}, fmt.Errorf("rank_pattern %q is %d: %w", k, v, ErrInvalid)
		}
	}
	if len(raw.RankPattern) > 0 {
		cfg.RankPattern = raw.RankPattern
	}
	if raw.BaseModel != nil {
		cfg.BaseModel = *raw.BaseModel
	}
	if err := cfg.parseTargets(raw.TargetModules); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

func (c *Config) parseTargets(raw json.RawMessage) error {
	if len(raw) == 0 || string(raw) == "null" {
		return fmt.Errorf("target_modules missing: %w", ErrInvalid)
	}
	if raw[0] == '"' {
		if err := json.Unmarshal(raw, &c.TargetPattern); err != nil {
			return fmt.Errorf("target_modules: %v: %w", err, ErrInvalid)
		}
		if c.TargetPattern == "" {
			return fmt.Errorf("target_modules is empty: %w", ErrInvalid)
		}
		return nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return fmt.Errorf("target_modules is neither a list of names nor a string: %w", ErrInvalid)
	}
	if len(list) == 0 {
		return fmt.Errorf("target_modules is empty: %w", ErrInvalid)
	}
	if len(list) > maxTargets {
		return fmt.Errorf("target_modules has %d entries, over %d: %w", len(list), maxTargets, ErrInvalid)
	}
	seen := make(map[string]bool, len(list))
	for _, t := range list {
		if t == "" {
			return fmt.Errorf("target_modules has an empty name: %w", ErrInvalid)
		}
		if !seen[t] {
			seen[t] = true
			c.TargetModules = append(c.TargetModules, t)
		}
	}
	return nil
}
