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
- name: TETHER_REDIS_URL
  value: {{ .Values.redis.url | quote }}
- name: TETHER_PG_DSN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.postgres.dsnSecret }}
      key: dsn
{{- end -}}
