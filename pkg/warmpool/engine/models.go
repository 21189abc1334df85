package engine

import (
	"encoding/json"
	"fmt"
)

// maxModels bounds the entries of a /v1/models listing.
const maxModels = 1 << 14

// modelList is the OpenAI-compatible GET /v1/models reply. vLLM and SGLang
// list the base model(s) with parent null, then each loaded adapter with
// parent set to its base and root set to the path it was loaded from.
type modelList struct {
	Data *[]struct {
		ID     string  `json:"id"`
		Root   *string `json:"root"`
		Parent *string `json:"parent"`
	} `json:"data"`
}

// decodeModels returns the adapters of a /v1/models reply: the entries with
// a parent.
func decodeModels(body []byte) ([]Adapter, error) {
	var l modelList
	if err := json.Unmarshal(body, &l); err != nil {
		return nil, fmt.Errorf("decoding the model list: %v: %w", err, ErrUnavailable)
	}
	if l.Data == nil {
		return nil, fmt.Errorf("model list without data: %w", ErrUnavailable)
	}
	if len(*l.Data) > maxModels {
		return nil, fmt.Errorf("model list of %d entries, over %d: %w", len(*l.Data), maxModels, ErrUnavailable)
	}
	as := []Adapter{}
	seen := map[string]bool{}
	for _, m := range *l.Data {
		if m.Parent == nil || *m.Parent == "" {
			continue
		}
		if m.ID == "" {
			return nil, fmt.Errorf("model list has an adapter without an id: %w", ErrUnavailable)
		}
		if seen[m.ID] {
			continue
		}
		seen[m.ID] = true
		a := Adapter{Name: m.ID, Parent: *m.Parent}
		if m.Root != nil {
			a.Path = *m.Root
		}
		as = append(as, a)
	}
	return as, nil
}
