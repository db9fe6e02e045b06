{{- define "tether.labels" -}}
app.kubernetes.io/part-of: tether
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{/* Environment shared by every service: infrastructure addresses, never secrets in clear. */}}
{{- define "tether.commonEnv" -}}
- name: TETHER_KAFKA_BOOTSTRAP
  value: {{ .Values.kafka.bootstrap | quote }}
- name: TETHER_PARTITIONS
  value: {{ .Values.kafka.partitions | quote }}
- name: TETHER_TOPIC_REPLICATION_FACTOR
  value: {{ .Values.kafka.replicationFactor | quote }}
{{- with .Values.schemaWriteRelease }}
- name: TETHER_SCHEMA_WRITE_RELEASE
  value: {{ . | quote }}
{{- end }}
- name: TETHER_PG_DSN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.postgres.dsnSecret }}
      key: dsn
{{- end -}}

{{/* TETHER_REDIS_URL, for the services that read it (services.<name>.needsRedis): from the Secret
redis.urlSecret (key `url`) when set, else redis.url, which may not hold credentials. */}}
{{- define "tether.redisEnv" -}}
{{- if .Values.redis.urlSecret -}}
- name: TETHER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.urlSecret }}
      key: url
{{- else -}}
{{- if regexMatch "^[^:/]+://[^/]*@" (.Values.redis.url | default "") -}}
{{- fail "redis.url holds credentials (user or password before '@'): put the URL in a Secret under key `url` and set redis.urlSecret to its name" -}}
{{- end -}}
{{- if not .Values.redis.url -}}
{{- fail "redis.url or redis.urlSecret must be set: run-api, tool-gateway and the projector read Redis" -}}
{{- end -}}
- name: TETHER_REDIS_URL
  value: {{ .Values.redis.url | quote }}
{{- end -}}
{{- end -}}


{{/* A service's security context: the chart-wide one with the service's own keys merged over it.
Called with (list $ $svc "podSecurityContext") or (list $ $svc "securityContext"). */}}
{{- define "tether.securityContext" -}}
{{- $root := index . 0 -}}
{{- $svc := index . 1 -}}
{{- $key := index . 2 -}}
{{- $base := deepCopy (index $root.Values $key | default dict) -}}
{{- toYaml (mergeOverwrite $base (deepCopy (index $svc $key | default dict))) -}}
{{- end -}}
