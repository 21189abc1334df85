package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/alecthomas/kong"
	kongyaml "github.com/alecthomas/kong-yaml"
	"gopkg.in/yaml.v3"
)

// yamlConfig resolves flags from a YAML file (kong-yaml: keys are the flag
// names under their command, "agent: {budget-percent: 70}"). It adds two
// things: a flag whose environment variable is set is left to the
// environment, so the order is flag > environment > file > default; and a key
// that names no flag is an error, not a silently ignored typo.
type yamlConfig struct {
	kong.Resolver
	keys []string // every key of the file, nested keys joined with '-'
}

// loadYAMLConfig is the kong.ConfigurationLoader of --config.
func loadYAMLConfig(r io.Reader) (kong.Resolver, error) {
	data, err := io.ReadAll(io.LimitReader(r, 1<<20))
	if err != nil {
		return nil, err
	}
	res, err := kongyaml.Loader(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	var doc map[string]any
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return &yamlConfig{Resolver: res, keys: flattenKeys("", doc)}, nil
}

func flattenKeys(prefix string, m map[string]any) []string {
	var keys []string
	for k, v := range m {
		if child, ok := v.(map[string]any); ok {
			keys = append(keys, flattenKeys(prefix+k+"-", child)...)
			continue
		}
		keys = append(keys, prefix+k)
	}
	slices.Sort(keys)
	return keys
}

func (y *yamlConfig) Resolve(ctx *kong.Context, parent *kong.Path, flag *kong.Flag) (any, error) {
	for _, env := range flag.Envs {
		if _, ok := os.LookupEnv(env); ok {
			return nil, nil
		}
	}
	return y.Resolver.Resolve(ctx, parent, flag)
}

// Validate rejects keys that name no flag of any command; under a map flag
// (origin-limits: {hf: 1GiB}) any key is the map's.
func (y *yamlConfig) Validate(app *kong.Application) error {
	known := map[string]bool{}
	var maps []string
	var walk func(prefix string, n *kong.Node)
	walk = func(prefix string, n *kong.Node) {
		for _, f := range n.Flags {
			known[prefix+f.Name] = true
			if f.IsMap() {
				maps = append(maps, prefix+f.Name+"-")
			}
		}
		for _, c := range n.Children {
			walk(prefix+c.Name+"-", c)
		}
	}
	walk("", app.Node)
	var unknown []string
	for _, k := range y.keys {
		if !known[k] && !slices.ContainsFunc(maps, func(m string) bool { return strings.HasPrefix(k, m) }) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		return fmt.Errorf("config: unknown keys %s (keys are flag names under their command, such as agent: {budget-percent: 70})", strings.Join(unknown, ", "))
	}
	return nil
}
